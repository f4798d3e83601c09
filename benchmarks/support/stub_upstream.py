"""A stub upstream (NOT vLLM): answers Chat Completions in vLLM's shape after a fixed delay.

Named as a stub everywhere it is used. It serves the proxy-overhead benchmark (where a
fixed latency makes the proxy's own cost measurable) and fault injection in tests (slow
answers, slow streams). Token ids are fake but well-formed: the prompt's length in ids, 8 completion ids.
Run alone: python -m benchmarks.support.stub_upstream --port 9000 --latency 0.02
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from proxy.bridge import CARD, KEY, bridge

MODEL = "stub-model"
COMPLETION = [101, 102, 103, 104, 105, 106, 107, 2]


def _choice(stream: bool, index: int, text: str, token_ids: list[int], finish: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": token_ids}
    body["logprobs"] = {
        "content": [{"token": str(t), "logprob": -0.5, "bytes": [], "top_logprobs": []} for t in token_ids]
    }
    if stream:
        body["delta"] = {"role": "assistant", "content": text}
    else:
        body["message"] = {"role": "assistant", "content": text}
    return body


def render(messages: list[Any], bytes_a_token: int | None = None) -> list[int]:
    """The stub's chat template: a start token, then per message a few ids its text decides and
    the end-of-turn token 2 (as sampled answers end), then the generation prompt's token 3. With
    `bytes_a_token`, a message also makes an id for every that many bytes of its text, as a real
    tokenizer's count grows with the text."""
    ids = [1]
    for message in messages:
        text = orjson.dumps(message.get("content") if isinstance(message, dict) else message)
        if bytes_a_token:
            ids += [200 + byte for byte in text[::bytes_a_token]]
        ids += [200 + len(text) % 700, 200 + sum(text) % 700, 2]
    return [*ids, 3]


def stub_app(
    latency: float = 0.0,
    first_latency: float | None = None,
    token_delay: float = 0.0,
    drop_token_ids_at: int | None = None,
    break_at: int | None = None,
    die_at: int | None = None,
    answer: str = "stub answer",
    answers: list[str] | None = None,
    summary: str | None = None,
    provider_key: str | None = None,
    stream_words: list[str] | None = None,
    choiceless_first: bool = False,
    garbled_at: int | None = None,
    tool_calls: list[tuple[str, str]] | None = None,
    tokenize: bool = True,
    bridges: bool = True,
    bytes_a_token: int | None = None,
) -> FastAPI:
    """Faults: `first_latency` is how long the first chat call takes (the others `latency`);
    `drop_token_ids_at` is the stream chunk sent without its token ids; at `break_at`
    the stream sends a malformed event and ends, without `[DONE]`; at `die_at` the server fails
    mid-stream and the connection is cut, as when the upstream dies; with `choiceless_first` the
    stream opens with a chunk that has no choices and no usage; at `garbled_at` a chunk's
    `tool_calls` is a string, valid JSON that no translator can follow (and so is a whole
    answer's). With `provider_key` it acts as a provider other than vLLM: it wants that key,
    refuses vLLM's `return_token_ids` (400, as OpenAI does) and answers without token ids or
    logprobs. A stream's text is `t<id> ` per token, or the given `stream_words`, one per token
    (a scripted answer, below: in 8 pieces). With `tool_calls` ((name, JSON arguments) each) a
    stream calls those tools as vLLM's tool parser streams them: a call's id and name in its
    first delta, its arguments in pieces after, one token a chunk. It renders chats as `render`
    says (`POST /tokenize`, unless `tokenize` is false) and takes token-in prompts
    (`kv_transfer_params.prompt_token_ids`) as vLLM does, and unless `bridges` is false makes
    token-in's bridges as rl-proxy's vLLM plugin does (proxy/bridge.py); `bytes_a_token` makes
    prompts as long as real ones (`render`). `renderings` counts its
    `/tokenize` calls. With `answers`, a scripted model: an
    answer's text is the conversation's nth (n: its assistant messages so far; the last one
    after), whole or streamed; with `tool_calls` too, a stream's first answer is those calls;
    with `summary`, the answer where the last message asks for a <summary> block (Claude Code's
    compaction)."""
    app = FastAPI()
    app.state.renderings = 0
    served: list[int] = []  # chat calls answered so far

    @app.post("/tokenize")
    async def render_route(request: Request) -> Response:
        if provider_key is not None or not tokenize:  # another provider: no such route
            return Response(orjson.dumps({"detail": "Not Found"}), 404)
        app.state.renderings += 1
        tokens = render((orjson.loads(await request.body())).get("messages") or [], bytes_a_token)
        return Response(orjson.dumps({"tokens": tokens, "count": len(tokens)}), media_type="application/json")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"} | ({CARD: True} if bridges else {})]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if provider_key is not None:
            if request.headers.get("authorization") != f"Bearer {provider_key}":
                return Response(orjson.dumps({"error": {"message": "Incorrect API key provided"}}), 401)
            if "return_token_ids" in body:
                unknown = {"error": {"message": "Unrecognized request argument supplied: return_token_ids"}}
                return Response(orjson.dumps(unknown), 400)
        first = not served
        served.append(1)
        await asyncio.sleep(first_latency if first_latency is not None and first else latency)
        given = body.get("kv_transfer_params") or {}
        prompt = given.get("prompt_token_ids") or render(body.get("messages") or [], bytes_a_token)  # token-in, as vLLM
        if bridges and given.get(KEY):
            thread = given[KEY]

            async def history() -> list[int]:
                return render(body["messages"][: thread["echoed"]], bytes_a_token)

            made = await bridge(prompt, thread, history)
            prompt = prompt if isinstance(made, str) else thread["prefix"] + made
        head = {"id": f"chatcmpl-stub-{time.monotonic_ns()}", "created": int(time.time()), "model": MODEL}
        messages = body.get("messages") or []
        turn = sum(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
        text = answers[min(turn, len(answers) - 1)] if answers else answer
        if summary is not None and messages and "<summary>" in orjson.dumps(messages[-1]).decode():
            text = summary
        if not body.get("stream"):
            out = {
                **head,
                "object": "chat.completion",
                "prompt_token_ids": prompt,
                "choices": [_choice(False, 0, text, COMPLETION, "stop")],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(COMPLETION)},
            }
            if provider_key is not None:
                del out["prompt_token_ids"], out["choices"][0]["token_ids"], out["choices"][0]["logprobs"]
            if garbled_at is not None:
                out["choices"][0]["message"]["tool_calls"] = "garbled"
            return Response(orjson.dumps(out), media_type="application/json")

        async def calls():  # type: ignore[no-untyped-def]
            deltas: list[dict[str, Any]] = []
            for i, (name, arguments) in enumerate(tool_calls or []):
                opened = {
                    "index": i,
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
                half = len(arguments) // 2
                deltas += [{"tool_calls": [opened]}] + [
                    {"tool_calls": [{"index": i, "function": {"arguments": part}}]}
                    for part in (arguments[:half], arguments[half:])
                ]
            for n, delta in enumerate([*deltas, {}]):
                finish = "tool_calls" if n == len(deltas) else None
                choice = {**_choice(True, 0, "", [200 + n], finish), "delta": delta}
                first = {"prompt_token_ids": prompt} if n == 0 else {}
                yield (
                    b"data: "
                    + orjson.dumps({**head, "object": "chat.completion.chunk", **first, "choices": [choice]})
                    + b"\n\n"
                )
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(deltas) + 1}
            yield b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        if tool_calls and not (answers and turn):  # scripted: the tools are the first answer
            return StreamingResponse(calls(), media_type="text/event-stream")

        async def events():  # type: ignore[no-untyped-def]
            chunk = {**head, "object": "chat.completion.chunk", "prompt_token_ids": prompt}
            if choiceless_first:
                yield b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": []}) + b"\n\n"
            for i, token in enumerate(COMPLETION):
                if i == break_at:
                    yield b'data: {"choices": [{"delta": \n\n'
                    return
                if i == die_at:
                    raise ConnectionAbortedError("stub upstream dies mid-stream (fault injection)")
                finish = "stop" if i == len(COMPLETION) - 1 else None
                if answers:  # the scripted answer, in as many pieces as tokens
                    piece = -(-len(text) // len(COMPLETION))
                    word = text[i * piece : (i + 1) * piece]
                else:
                    word = stream_words[i % len(stream_words)] if stream_words else f"t{token} "
                chunk["choices"] = [_choice(True, 0, word, [token], finish)]
                if i == garbled_at:
                    chunk["choices"][0]["delta"]["tool_calls"] = "garbled"
                if i == drop_token_ids_at or provider_key is not None:
                    chunk.pop("prompt_token_ids", None)
                    del chunk["choices"][0]["token_ids"]
                    chunk["choices"][0]["logprobs"] = None
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                chunk.pop("prompt_token_ids", None)
                await asyncio.sleep(token_delay)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt), "completion_tokens": len(COMPLETION)}
                yield b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """Text completions, whole or streamed, of the same COMPLETION ids; the prompt's ids are
        what `render` makes of its text."""
        body = orjson.loads(await request.body())
        await asyncio.sleep(latency)
        prompt = render([body.get("prompt")])
        head = {"id": f"cmpl-stub-{time.monotonic_ns()}", "object": "text_completion", "model": MODEL}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(COMPLETION)}

        def choice(text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
            logprobs = {"tokens": [str(t) for t in ids], "token_logprobs": [-0.5] * len(ids)}
            return {"index": 0, "text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish}

        if not body.get("stream"):
            whole = {
                **head,
                "prompt_token_ids": prompt,
                "choices": [choice(answer, COMPLETION, "stop")],
                "usage": usage,
            }
            return Response(orjson.dumps(whole), media_type="application/json")

        async def events():  # type: ignore[no-untyped-def]
            for i, token in enumerate(COMPLETION):
                last = i == len(COMPLETION) - 1
                first = {"prompt_token_ids": prompt} if i == 0 else {}
                chunk = {**head, **first, "choices": [choice(f"t{token} ", [token], "stop" if last else None)]}
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--no-bridges", action="store_true", help="token-in's bridges are cut by the proxy")
    parser.add_argument("--bytes-a-token", type=int, help="prompts as long as real ones: an id per that many bytes")
    args = parser.parse_args()
    uvicorn.run(
        stub_app(args.latency, bridges=not args.no_bridges, bytes_a_token=args.bytes_a_token),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )
