"""Token-in's own work on a continuing call as the conversation grows (`make bench`): what the
proxy's event loop spends planning one call's prompt, in process, at agent-sized histories.

A session of `turns` turns (a user message, an assistant answer with a tool call, a tool result;
about 3 KB and 760 tokens a turn, as a coding agent's) is held as a thread, and the next call
(its echoed answer and one tool result more) is planned: its keys (`Threads.keys`: the history
checked as the thread's, the new messages digested), then `Threads.plan`, then the prompt dumped
into the body forwarded to vLLM.
Both ways to cut the bridge: by the proxy, from the upstream's rendering as /tokenize answers it
(JSON parsed; the round trip comes on top), or by vLLM with rl-proxy's plugin (the proxy sends the
thread's ids and counts). The upstream is a STUB in process (it hands back a prepared /tokenize
answer, no HTTP, no template), so what is timed is the proxy's own CPU. Medians of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import time
from array import array
from types import SimpleNamespace
from typing import Any

import orjson

from proxy.threads import Answer, Threads, keys_of, thread_state, tools_key

EOT = 151645  # an end-of-turn token id as large as Qwen's, so that no small-int shortcut applies
TOKENS_A_TURN = (600, 40, 120)  # user and tool text, the answer's sampled ids, the tool result


def conversation(turns: int, rng: random.Random) -> tuple[list[dict[str, Any]], list[int]]:
    """A coding agent's history of `turns` turns, and its rendering's ids: one end-of-turn token
    closing each message, as chat templates render them."""

    def text(n: int) -> str:
        return "".join(rng.choice(string.ascii_letters + string.digits + ' \n"{}()=:.,') for _ in range(n))

    messages: list[dict[str, Any]] = [{"role": "system", "content": text(6000)}]
    ids = [rng.randrange(3, 150000) for _ in range(1500)] + [EOT]
    for t in range(turns):
        call = {
            "id": f"call_{t}",
            "type": "function",
            "function": {"name": "bash", "arguments": orjson.dumps({"cmd": text(80)}).decode()},
        }
        messages += [
            {"role": "user", "content": text(1200)},
            {"role": "assistant", "content": text(160), "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": text(1600)},
        ]
        for n in TOKENS_A_TURN:
            ids += [rng.randrange(3, 150000) for _ in range(n)] + [EOT]
    return messages, ids


class StubUpstream(SimpleNamespace):
    """A STUB upstream in process: its /tokenize answer is the prepared rendering, as JSON."""

    async def send(self, method: str, path: str, body: dict[str, Any], at_root: bool = False) -> Any:
        return SimpleNamespace(ok=True, status=200, body=self.rendering)

    async def read(self, resp: Any) -> bytes:
        return resp.body


async def plan_once(turns: int, repeats: int, bridges: bool) -> dict[str, float]:
    """ms a call, medians: the digests, the plan (with `bridges`, the upstream's to cut the bridge;
    else the /tokenize answer parsed and the bridge cut), the forwarded body."""
    rng = random.Random(turns)
    messages, ids = conversation(turns, rng)
    # The thread is the call before the last turn's answer: its prompt, then its sampled answer.
    held, answer = messages[:-2], messages[-2]
    cut = len(ids) - TOKENS_A_TURN[2] - 1 - TOKENS_A_TURN[1] - 1
    prompt, sampled = ids[:cut], ids[cut : cut + TOKENS_A_TURN[1] + 1]
    body = {"model": "m", "messages": messages}
    rendering = orjson.dumps({"tokens": ids, "count": len(ids)})
    upstream = StubUpstream(base_url="http://stub/v1", rendering=rendering, bridges=bridges)
    threads = Threads()
    answers = [Answer(answer, array("i", sampled), "tool_calls")]
    kept = keys_of({"model": "m", "messages": held})
    state = thread_state({"model": "m", "messages": held}, answers, None, kept)
    threads.add("s", "c1", state, array("i", prompt), answers, kept.whole)
    threads.end_of_turn[tools_key({**body, "tools": None}) + b"m"] = EOT
    times: dict[str, list[float]] = {"digests": [], "plan": [], "body": []}
    for _ in range(repeats):
        start = time.perf_counter()
        keys = threads.keys("s", body)
        digested = time.perf_counter()
        plan = await threads.plan(upstream, "s", body, "c2", keys=keys)
        planned = time.perf_counter()
        orjson.dumps({**body, "kv_transfer_params": plan.kv_transfer_params()})
        done = time.perf_counter()
        assert plan.prompt_ids is not None and plan.prompt_ids.tolist() == (prompt + sampled if bridges else ids)
        for name, (a, b) in {
            "digests": (start, digested),
            "plan": (digested, planned),
            "body": (planned, done),
        }.items():
            times[name].append((b - a) * 1000)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return medians | {"messages": len(messages), "tokens": len(ids), "kb": len(orjson.dumps(messages)) / 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 40, 160])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(
        "\nToken-in's own CPU on a continuing call, ms (in process, STUB /tokenize answer; "
        f"medians of {args.repeats})\n\n"
        "| turns | messages | history KB | prompt tokens | bridge cut by | digests | plan | body dumped | all |\n"
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|"
    )
    for turns in args.turns:
        for bridges in (False, True):
            got = asyncio.run(plan_once(turns, args.repeats, bridges))
            total = got["digests"] + got["plan"] + got["body"]
            print(
                f"| {turns} | {got['messages']} | {got['kb']:.0f} | {got['tokens']:,} "
                f"| {'vLLM (plugin)' if bridges else 'the proxy (/tokenize JSON)'} | {got['digests']:.3f} "
                f"| {got['plan']:.3f} | {got['body']:.3f} | {total:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
