"""vLLM's CPU build in bfloat16 against float32, and with one CPU held back against none
(`python -m benchmarks.bench_vllm_dtype`): the default model read from a long prompt, and decoded
one stream and 8 at a time, one server per setting on this machine, one after the other. On a CPU
without bfloat16 instructions vLLM emulates them, and rl-proxy starts it in float32 there
(proxy/vllm.py `dtype_args`): this shows why, and on a CPU that has them, whether vLLM's own
bfloat16 is the faster. vLLM also keeps one CPU for its server processes; the last row keeps none
(`VLLM_CPU_NUM_OF_RESERVED_CPU=0`): faster serving on two CPUs, but rl-proxy leaves vLLM's choice,
since a learner training beside it was slower (docs/development.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI

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
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for dtype, reserved in (("bfloat16", "1"), ("float32", "1"), ("float32", "0")):
            print(f"starting vLLM in {dtype}, {reserved} CPU held back", flush=True)
            extra = ["--enforce-eager", "--dtype", dtype]
            log = Path(logs) / f"{dtype}-{reserved}.log"
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
            with VllmServer(path, name, log_file=log, max_model_len=8192, extra_args=extra) as server:
                client = AsyncOpenAI(base_url=server.base_url, api_key="bench", timeout=600)
                rows.append((dtype, reserved, *asyncio.run(measure(client, name, args.rounds))))
    print(f"\n{len(os.sched_getaffinity(0))} CPUs")
    print("| dtype | CPUs held back | 4,900-token prompt s | 1 stream tokens/s | 8 streams tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for dtype, reserved, read, one, eight in rows:
        print(f"| {dtype} | {reserved} | {read:.1f} | {one:.1f} | {eight:.1f} |")


if __name__ == "__main__":
    main()
