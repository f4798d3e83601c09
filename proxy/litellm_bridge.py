"""What the translating routes (anthropic.py, responses.py) share around litellm's in-process
translators: importing litellm quietly, and turning its pydantic objects into plain JSON."""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import orjson


@cache
def litellm() -> Any:
    """litellm, imported once: it takes seconds, would fetch a price list without the variable,
    and prints a provider hint to stdout for every model name it does not know."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
    return litellm


def _plain(obj: Any) -> Any:
    # warnings=False: litellm's union-typed fields would otherwise have pydantic format a repr of
    # the whole object for a warning nobody reads (half the cost of translating an answer).
    return obj.model_dump(warnings=False) if hasattr(obj, "model_dump") else str(obj)


def jsonable(obj: Any) -> Any:
    return orjson.loads(orjson.dumps(obj, default=_plain))
