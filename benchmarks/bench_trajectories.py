"""Reconstruction benchmark (part of `make bench`): a synthetic store of 100,000 calls
(10,000 sessions of 10 turns, each prompt extending the last), rebuilt into training sequences.
Reports calls per second (reading from SQLite and building, and building alone) and the
training tokens with prefix merging against one sample per call."""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from datetime import datetime
from pathlib import Path

from recorder import CallRecord, Completion, SessionInfo, Store
from recorder.graph import build_sequences

T0 = datetime(2026, 1, 1)


def session_calls(sid: str, turns: int, rng: random.Random, vocab: int = 50_000) -> list[CallRecord]:
    prompt = [rng.randrange(vocab) for _ in range(200)]  # system prompt and task
    calls = []
    for seq in range(1, turns + 1):
        tokens = [rng.randrange(vocab) for _ in range(30)] + [2]
        calls.append(
            CallRecord(
                session_id=sid,
                seq=seq,
                api="chat.completions",
                model="m",
                upstream="u",
                stream=False,
                request={"messages": [{"role": "user", "content": "..."}]},
                response=None,
                ok=True,
                http_status=200,
                error=None,
                prompt_token_ids=list(prompt),
                completions=[Completion(0, tokens, [-0.5] * len(tokens), "stop")],
                policy_version="v1",
                policy_version_end="v1",
                started_at=T0,
                finished_at=T0,
            )
        )
        prompt = prompt + tokens + [rng.randrange(vocab) for _ in range(50)]  # tool output, next turn
    return calls


async def main(sessions: int, turns: int) -> None:
    rng = random.Random(0)
    db = Path(tempfile.mkdtemp(prefix="rlp-bench-traj-")) / "calls.db"
    async with Store(str(db)) as store:
        start = time.perf_counter()
        for i in range(sessions):
            sid = f"s{i}"
            await store.resolve_session(SessionInfo(id=sid, key=sid))
            await asyncio.gather(*(store.record(c) for c in session_calls(sid, turns, rng)))
            if i % 1000 == 999:
                rate = (i + 1) * turns / (time.perf_counter() - start)
                print(f"\r  writing synthetic store: {(i + 1) * turns} calls, {rate:.0f} calls/s", end="", flush=True)
        print()
        start = time.perf_counter()
        build_time = 0.0
        merged = unmerged = sequences = 0
        for session in await store.list_sessions():
            calls = [c async for c in store.iter_calls(session.id)]
            t = time.perf_counter()
            report = build_sequences(calls, session)
            build_time += time.perf_counter() - t
            merged += report.tokens
            unmerged += report.unmerged_tokens
            sequences += len(report.sequences)
        total = time.perf_counter() - start
    calls_n = sessions * turns
    print(f"\nReconstruction of {calls_n} calls ({sessions} sessions x {turns} turns), {sequences} sequences\n")
    print("| what | calls/s |\n|---|---:|")
    print(f"| read from SQLite + build | {calls_n / total:,.0f} |")
    print(f"| build alone | {calls_n / build_time:,.0f} |")
    print("\n| training tokens | total | per session |\n|---|---:|---:|")
    print(f"| one sample per call | {unmerged:,} | {unmerged / sessions:,.0f} |")
    print(f"| prefix-merged | {merged:,} | {merged / sessions:,.0f} |")
    print(f"\nmerging trains on {unmerged / merged:.2f}x fewer tokens for the same sampled tokens")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.sessions, args.turns))
