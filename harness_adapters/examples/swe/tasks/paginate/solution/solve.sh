#!/bin/bash
# The fix, in /app (the image's working directory).
python3 - <<'EOF'
from pathlib import Path


def fix(path, old, new):
    source = Path(path).read_text()
    assert old in source, (path, old)
    Path(path).write_text(source.replace(old, new, 1))


fix('pager/pages.py', 'return total // per_page', 'return -(-total // per_page)')
EOF
