"""What the translating routes (anthropic.py, responses.py) share around litellm's in-process
translators: importing litellm quietly, what its translators raise for a request they cannot
take, and turning its pydantic objects into plain JSON."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from functools import cache
from typing import Any

import orjson
from pydantic import BaseModel

from proxy import heap


@cache
def litellm() -> Any:
    """litellm, imported once: it takes seconds, would fetch a price list without the variable,
    and prints a provider hint to stdout for every model name it does not know."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
    return litellm


@cache
def _importing() -> Future[Any]:
    """The import, started once in a thread of its own."""
    done: Future[Any] = Future()

    def run() -> None:
        try:
            imported = litellm()
            heap.resettle()  # its objects out of the collections, as those of the start-up
            done.set_result(imported)
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=run, name="litellm-import", daemon=True).start()
    return done


async def imported() -> None:
    """litellm imported in a thread by the first call that translates, and awaited by the calls
    that come meanwhile (on one import, not a worker thread each: those are the loop's DNS
    lookups too). Imported on the event loop, it held up every call in flight for seconds;
    imported at start-up, it made every proxy start 6 s later (twice a plain import of the
    proxy) though most never receive a Messages or Responses call."""
    if litellm.cache_info().currsize == 0:
        await asyncio.wrap_future(_importing())


def refusals() -> tuple[type[Exception], ...]:
    """What litellm's translators raise for a request they cannot take: Python's own errors, and
    its BadRequestError (UnsupportedParamsError for a tool of the wrong shape, say), which the
    routes answer as the client's error (400), not the proxy's (500). Called in an `except`
    clause, so only once something was raised: litellm is imported by then."""
    return (ValueError, TypeError, KeyError, AttributeError, litellm().exceptions.BadRequestError)


def _plain(obj: Any) -> Any:
    # A model's fields as they are (orjson comes back for the nested ones), not model_dump():
    # litellm's response types have a serializer that makes pydantic format a repr of the whole
    # object for every answer (more than half the cost of translating one).
    return dict(obj) if isinstance(obj, BaseModel) else str(obj)


def jsonable(obj: Any) -> Any:
    return orjson.loads(orjson.dumps(obj, default=_plain))
