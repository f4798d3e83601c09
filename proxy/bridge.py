"""The bridge of a continuing call: the tokens of its new messages, cut from the rendering of its
whole request (proxy/threads.py, "Token-in"). Plain code with no imports of the proxy's, so that
both sides make it alike: the proxy, after a `/tokenize` of the request, and rl-proxy's vLLM plugin
(proxy/vllm_plugin.py), inside the chat route where vLLM renders the request anyway; then a
continuing call costs no round trip more than any other.

The proxy asks the plugin for it by sending, instead of the prompt's ids, the thread in
`kv_transfer_params[KEY]`: `prefix` (the thread's prompt and sampled ids), `eot` (the template's
end-of-turn token), `n` (how many of them the prefix holds, counting the one that closes the echoed
answer), `later` (the messages after the echoed answer), `closed` (whether the sampled ids end
with `eot`) and `echoed` (how many messages, up to the echoed answer, the history rendering holds).
A vLLM that makes bridges says so in each of its model cards (`CARD`, in `GET /v1/models`).
"""

from __future__ import annotations

from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

KEY = "rl_proxy_thread"  # the entry of a chat request's kv_transfer_params the plugin bridges from
CARD = "rl_proxy_bridge"  # a model card's field: true where the upstream makes bridges


Ids = Sequence[int]  # vLLM's rendering (a list), or the proxy's from /tokenize (an array('i'), read by numpy)


def _ends(ids: Ids, eot: int) -> Any:
    """Where `eot` is in an array of ids (numpy: no Python int made for each), else None."""
    return np.flatnonzero(np.frombuffer(ids, np.intc) == eot) if isinstance(ids, array) else None


def _count(ids: Ids, eot: int) -> int:
    ends = _ends(ids, eot)
    return ids.count(eot) if ends is None else len(ends)


async def bridge(rendered: Ids, thread: dict[str, Any], history: Callable[[], Awaitable[Ids | str]]) -> Ids | str:
    """The tokens that follow the echoed answer's end of turn in `rendered`, or why none can be
    cut. When the rendering does not hold one more end-of-turn token for each later message (a
    template that merges or drops turns), the history up to the echoed answer (`history()`,
    rendered only then, or why it could not be) must hold `n`."""
    eot, n = thread["eot"], thread["n"]
    ends = _ends(rendered, eot)
    count = rendered.count(eot) if ends is None else len(ends)
    if count != n + thread["later"]:
        held = await history()
        if isinstance(held, str):
            return held
        if (found := _count(held, eot)) != n:
            return (
                f"the template renders the conversation with {found} end-of-turn "
                f"tokens up to the echoed answer, its tokens hold {n}"
            )
    if count < n:
        return f"the rendering has no end-of-turn token {eot} after the echoed answer"
    if ends is not None:
        at = int(ends[n - 1])  # the n-th end-of-turn token
    else:  # found from the end: only the new messages' tokens are scanned
        back, back_at = rendered[::-1], -1
        for _ in range(count - n + 1):
            back_at = back.index(eot, back_at + 1)
        at = len(rendered) - 1 - back_at
    if at >= len(rendered) - 1:
        return f"the rendering has no end-of-turn token {eot} after the echoed answer"
    return rendered[at + (1 if thread["closed"] else 0) :]
