#!/bin/bash
# The fix, in /app (the image's working directory).
python3 - <<'EOF'
from pathlib import Path


def fix(path, old, new):
    source = Path(path).read_text()
    assert old in source, (path, old)
    Path(path).write_text(source.replace(old, new, 1))


fix('tags/store.py', 'tags=[]', 'tags=None')
fix('tags/store.py', '    tags.append(tag)', '    tags = [] if tags is None else tags\n    tags.append(tag)')
EOF
