"""Streams in flight for the weight-swap tests and benchmarks: streamed chat calls that have each
sampled their first text when a new version comes in; and a probe of which weights serve."""

from __future__ import annotations

import asyncio

import httpx
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


async def streams_in_flight(
    client: AsyncOpenAI, model: str, n: int, tokens: int, freeze: str | None = None
) -> list[asyncio.Task[str]]:
    """`n` streams of `tokens` tokens each (`min_tokens`: none stops early), returned once every
    one has sampled its first text; each task's result is its text. With `freeze` (the root URL
    of the one vLLM behind the proxy), that vLLM is returned paused (mode keep: the streams
    freeze) and is stepped a few steps at a time until then: on a busy machine the streams
    reach vLLM seconds apart and their first texts reach the client late, and the first ones
    could end before the last had started (CI, three times). The caller's swap resumes it."""
    first_texts = 0
    every_one_sampled = asyncio.Event()

    def sampled() -> None:
        nonlocal first_texts
        first_texts += 1
        if first_texts == n:
            every_one_sampled.set()

    async def stream() -> str:
        text = ""
        try:
            response = await client.chat.completions.create(
                model=model,
                messages=PROMPT,
                max_tokens=tokens,
                temperature=1.0,
                stream=True,
                extra_body={"min_tokens": tokens},
            )
            async for chunk in response:
                delta = (chunk.choices[0].delta.content or "") if chunk.choices else ""
                if delta and not text:  # once per stream, at its first sampled text
                    sampled()
                text += delta
        finally:
            if not text:  # failed before sampling: the swap must not wait for it forever
                sampled()
        return text

    streams = [asyncio.create_task(stream()) for _ in range(n)]
    if freeze:
        await _step_until(freeze, every_one_sampled, streams)
    else:
        await every_one_sampled.wait()
    if any(s.done() for s in streams):
        await asyncio.gather(*streams)  # a stream that ended before the swap: raise its error
        raise AssertionError("a stream ended before the swap")
    return streams


async def _generated(http: httpx.AsyncClient, root: str) -> float:
    """The tokens vLLM at `root` has sampled, from its Prometheus metrics (summed over engines)."""
    text = (await http.get(f"{root}/metrics")).raise_for_status().text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:generation_tokens_total"
    )


async def _step_until(root: str, done: asyncio.Event, streams: list[asyncio.Task[str]]) -> None:
    """Let vLLM at `root` sample a step or a few, pause it, and give what it sampled a few seconds
    to reach the clients; again until `done` is set (or a stream ended). Paused, no stream can
    end, however slowly the machine delivers the streams."""
    async with httpx.AsyncClient(timeout=60) as http:
        while not any(s.done() for s in streams):
            generated = await _generated(http, root)
            while not any(s.done() for s in streams) and await _generated(http, root) == generated:
                await asyncio.sleep(0.02)
            (await http.post(f"{root}/pause", params={"mode": "keep"})).raise_for_status()
            try:
                await asyncio.wait_for(done.wait(), timeout=5)
                return
            except TimeoutError:
                (await http.post(f"{root}/resume")).raise_for_status()


async def first_logprob(client: AsyncOpenAI, model: str) -> float:
    """The greedy first token's logprob for PROMPT: it moves when other weights serve."""
    answer = await client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=1, temperature=0, logprobs=True
    )
    return answer.choices[0].logprobs.content[0].logprob  # type: ignore[union-attr,index]
