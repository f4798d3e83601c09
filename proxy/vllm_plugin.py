"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml), loaded by every
vLLM process started from this environment: on vLLM's CPU build, its engine core waits for the
model's worker by sleeping on a socket, not by spinning.

vLLM's engine core reads each step's result from the worker through shared memory and, for a
second after every read, waits by calling sched_yield in a loop (`SpinCondition.busy_loop_s`). On
a GPU that spares a few microseconds a step. On the CPU build the worker runs the model on the
machine's cores, so while vLLM generates the spin holds a whole core of its own: 65 CPU-seconds
of the engine core beside the worker's 67, against 1.1 without it, at about the same speed
(`python -m benchmarks.bench_vllm_dtype`, docs/benchmarks.md). rl-proxy's learner, its harnesses
and its proxy share that core. After a read the engine core (and the worker) now wait on the
socket that the writer notifies at every write, as they already did after a second idle.

That socket drops a notification now and then, and a reader that missed one slept until vLLM's
recheck, 5 s later: a hot swap's pause and reload took seconds longer (the swap tests 10-25 s
more each). The recheck is 20 ms here; idle, a reader wakes 50 times a second for nothing, which
costs no measurable CPU.

A second plugin (`register_bridge`, entry point `rl_proxy_bridge`) makes token-in's bridge in the
API server's chat route (proxy/bridge.py): a request whose `kv_transfer_params` hold a thread of
rl-proxy's is rendered as usual, and the prompt sent to the engine is the thread's ids and the
tokens that the rendering holds after the echoed answer; the answer is parsed and shaped as for
any chat. Where no bridge can be cut the rendering is the prompt, as for any chat, and the log says
why (rl-proxy then records the call as a new thread). Each model card says `rl_proxy_bridge: true`.

`VLLM_PLUGINS` (vLLM's own setting) names the plugins a vLLM loads: leave `rl_proxy_cpu_wait` out
of it to keep vLLM's own wait, `rl_proxy_bridge` to have rl-proxy render through `/tokenize`.
"""

from __future__ import annotations

import sys
from typing import Any


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = 20
    init = shm_broadcast.SpinCondition.__init__

    def wait_on_the_socket(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.busy_loop_s = 0

    shm_broadcast.SpinCondition.__init__ = wait_on_the_socket


def register_bridge() -> None:
    if "vllm.renderers.online_renderer" not in sys.modules:  # not the API server: an engine core or worker
        return
    from vllm.logger import init_logger

    from proxy.bridge import CARD, KEY, bridge

    log = init_logger("vllm.rl_proxy_bridge")  # in vLLM's own log
    try:  # vLLM 0.32's internals: a vLLM where they moved serves on, and rl-proxy uses /tokenize
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs.engine import tokens_input
        from vllm.renderers.online_renderer import OnlineRenderer

        preprocess, show = OnlineRenderer.preprocess_chat, OpenAIServingModels.show_available_models
    except (ImportError, AttributeError) as exc:
        log.warning("rl-proxy's bridge is not loaded (%r): rl-proxy will render through /tokenize", exc)
        return
    if getattr(preprocess, "bridges", False):  # registered already
        return

    async def preprocess_chat(self: Any, request: Any, messages: list[Any], *args: Any, **kwargs: Any) -> Any:
        kv = getattr(request, "kv_transfer_params", None)
        thread = kv.pop(KEY, None) if isinstance(kv, dict) else None
        conversation, inputs = await preprocess(self, request, messages, *args, **kwargs)
        if thread is None or len(inputs) != 1 or inputs[0].get("type") != "token":  # media: rendered as sent
            return conversation, inputs
        prefix = thread.get("prefix") if isinstance(thread, dict) else None
        if not isinstance(prefix, list) or not prefix or any(type(t) is not int or t < 0 for t in prefix):
            raise VLLMValidationError(f"`kv_transfer_params['{KEY}']` holds no prefix of token ids", parameter=KEY)

        async def history() -> list[int]:
            plain = request.model_copy(update={"add_generation_prompt": False, "continue_final_message": False})
            _, [held] = await preprocess(self, plain, messages[: thread["echoed"]], *args, **kwargs)
            return list(held["prompt_token_ids"])

        try:
            made = await bridge(inputs[0]["prompt_token_ids"], thread, history)
        except (KeyError, TypeError, ValueError) as exc:  # a thread of another shape
            made = f"the thread cannot be read: {exc!r}"
        if isinstance(made, str):
            log.warning("rl-proxy's thread is not bridged (%s): the request is rendered as sent", made)
            return conversation, inputs
        prompt = prefix + list(made)
        self.renderer.validate_token_ids(prompt, parameter=KEY)
        return conversation, [tokens_input(prompt, cache_salt=inputs[0].get("cache_salt"))]

    async def show_available_models(self: Any) -> Any:
        models = await show(self)
        for card in models.data:
            setattr(card, CARD, True)
        return models

    preprocess_chat.bridges = True  # type: ignore[attr-defined]
    OnlineRenderer.preprocess_chat = preprocess_chat  # type: ignore[method-assign]
    OpenAIServingModels.show_available_models = show_available_models  # type: ignore[method-assign]
