"""Streams in flight for the weight-swap tests and benchmarks: streamed chat calls that have each
sampled their first text when a new version comes in; and a probe of which weights serve."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


async def streams_in_flight(client: AsyncOpenAI, model: str, n: int, tokens: int) -> list[asyncio.Task[str]]:
    """`n` streams of `tokens` tokens each (`min_tokens`: none stops early), returned once every
    one has sampled its first text; each task's result is its text."""
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
    for _ in range(n):
        await started.acquire()
    if any(s.done() for s in streams):
        await asyncio.gather(*streams)  # a stream that ended before the swap: raise its error
        raise AssertionError("a stream ended before the swap")
    return streams


async def first_logprob(client: AsyncOpenAI, model: str) -> float:
    """The greedy first token's logprob for PROMPT: it moves when other weights serve."""
    answer = await client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=1, temperature=0, logprobs=True
    )
    return answer.choices[0].logprobs.content[0].logprob  # type: ignore[union-attr,index]
