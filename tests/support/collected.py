"""What the collected tests use, worked out once per test process."""

from __future__ import annotations

import pytest

USED = pytest.StashKey[set[str]]()


def collected_use(session: pytest.Session, fixture: str) -> bool:
    """Whether any collected test uses `fixture` (a server worth starting ahead of it)."""
    if USED not in session.stash:
        session.stash[USED] = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    return fixture in session.stash[USED]
