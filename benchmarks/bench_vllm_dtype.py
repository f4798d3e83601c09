"""vLLM's CPU build in bfloat16 against float32, with one CPU held back against none, and with
its engine core spinning against sleeping (`python -m benchmarks.bench_vllm_dtype`): the default
model read from a long prompt, and decoded one stream and 8 at a time, one server per setting on
this machine, one after the other. On a CPU without bfloat16 instructions vLLM emulates them, and
rl-proxy starts it in float32 there (proxy/vllm.py `dtype_args`): this shows why, and on a CPU
that has them, whether vLLM's own bfloat16 is the faster. vLLM also keeps one CPU for its server
processes; the third row keeps none (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`): faster serving on two
CPUs, but rl-proxy leaves vLLM's choice, since a learner training beside it was slower
(docs/development.md). Each row also gives the CPU-seconds that vLLM's engine core and its model
worker spent while measured; the last row is vLLM's own wait, a spin, which rl-proxy's plugin
(proxy/vllm_plugin.py) replaces.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path

from openai import AsyncOpenAI

from benchmarks.support.stack import vllm_cpu_seconds
from proxy.model import resolve_model
from proxy.vllm import VllmServer


async def measure(client: AsyncOpenAI, model: str, rounds: int) -> tuple[float, float, float]:
    """Median seconds to read a 4,900-token prompt (a new one each round: no prefix cache), and
    decode tokens/s with one stream and with 8."""

    async def decode(streams: int) -> float:
        async def one() -> int:
            answer = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Write a story."}],
                max_tokens=128,
                extra_body={"min_tokens": 128},
            )
            return answer.usage.completion_tokens if answer.usage else 0

        start = time.monotonic()
        tokens = sum(await asyncio.gather(*(one() for _ in range(streams))))
        return tokens / (time.monotonic() - start)

    reads, ones, eights = [], [], []
    await decode(1)  # warm
    for i in range(rounds):
        prompt = f"{i} " + " ".join(f"word{j}" for j in range(1200))
        start = time.monotonic()
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=1)
        reads.append(time.monotonic() - start)
        ones.append(await decode(1))
        eights.append(await decode(8))
    return statistics.median(reads), statistics.median(ones), statistics.median(eights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path, name = resolve_model("default")
    # vLLM loads only the plugins VLLM_PLUGINS names, when it is set: every one but rl-proxy's.
    others = ",".join(p.name for p in entry_points(group="vllm.general_plugins") if p.name != "rl_proxy_cpu_wait")
    settings = [("bfloat16", "1", False), ("float32", "1", False), ("float32", "0", False), ("float32", "1", True)]
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for dtype, reserved, spins in settings:
            print(f"starting vLLM in {dtype}, {reserved} CPU held back{', spinning' if spins else ''}", flush=True)
            extra = ["--enforce-eager", "--dtype", dtype]
            log = Path(logs) / f"{dtype}-{reserved}-{spins}.log"
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
            if spins:
                os.environ["VLLM_PLUGINS"] = others
            with VllmServer(path, name, log_file=log, max_model_len=8192, extra_args=extra) as server:
                client = AsyncOpenAI(base_url=server.base_url, api_key="bench", timeout=600)
                assert server.process is not None
                before = vllm_cpu_seconds(server.process.pid)
                measured = asyncio.run(measure(client, name, args.rounds))
                after = vllm_cpu_seconds(server.process.pid)
                spent = [after[kind] - before[kind] for kind in ("EngineCore", "Worker")]
                rows.append((dtype, reserved, "spins" if spins else "sleeps", *measured, *spent))
            os.environ.pop("VLLM_PLUGINS", None)
    print(f"\n{len(os.sched_getaffinity(0))} CPUs")
    print(
        "| dtype | CPUs held back | engine core waits | 4,900-token prompt s | 1 stream tokens/s "
        "| 8 streams tokens/s | engine core CPU s | worker CPU s |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for dtype, reserved, wait, read, one, eight, engine, worker in rows:
        print(f"| {dtype} | {reserved} | {wait} | {read:.1f} | {one:.1f} | {eight:.1f} | {engine:.0f} | {worker:.0f} |")


if __name__ == "__main__":
    main()
