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

`VLLM_PLUGINS` (vLLM's own setting) names the plugins a vLLM loads: leave `rl_proxy_cpu_wait` out
of it to keep vLLM's own wait.
"""

from __future__ import annotations

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
