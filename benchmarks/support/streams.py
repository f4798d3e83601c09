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
    of the one vLLM behind the proxy), that vLLM is paused (mode keep: the streams freeze) as soon
    as its own metrics show the `n` sampling: a busy machine can hold the first texts back from
    the client until the streams have ended (CI, twice), but not from vLLM's metrics. The
    caller's swap resumes it."""
    started = asyncio.Semaphore(0)

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
                    started.release()
                text += delta
        finally:
            if not text:  # failed before sampling: the swap must not wait for it forever
                started.release()
        return text

    streams = [asyncio.create_task(stream()) for _ in range(n)]
    if freeze:
        await _freeze_when_sampling(freeze, n, streams)
    for _ in range(n):
        await started.acquire()
    if any(s.done() for s in streams):
        await asyncio.gather(*streams)  # a stream that ended before the swap: raise its error
        raise AssertionError("a stream ended before the swap")
    return streams


async def _metrics(http: httpx.AsyncClient, root: str) -> dict[str, float]:
    """vLLM's Prometheus metrics, each summed over its labels (engines)."""
    text = (await http.get(f"{root}/metrics")).raise_for_status().text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


async def _freeze_when_sampling(root: str, n: int, streams: list[asyncio.Task[str]]) -> None:
    """Pause vLLM at `root` once `n` requests run and, after that, one more step has sampled a
    token for each."""
    running_at: float | None = None
    async with httpx.AsyncClient(timeout=60) as http:
        while not any(s.done() for s in streams):
            found = await _metrics(http, root)
            tokens = found.get("vllm:generation_tokens_total", 0.0)
            if running_at is None and found.get("vllm:num_requests_running", 0) >= n:
                running_at = tokens
            if running_at is not None and tokens >= running_at + n:
                break
            await asyncio.sleep(0.02)
        (await http.post(f"{root}/pause", params={"mode": "keep"})).raise_for_status()


async def first_logprob(client: AsyncOpenAI, model: str) -> float:
    """The greedy first token's logprob for PROMPT: it moves when other weights serve."""
    answer = await client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=1, temperature=0, logprobs=True
    )
    return answer.choices[0].logprobs.content[0].logprob  # type: ignore[union-attr,index]
