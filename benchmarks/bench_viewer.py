"""Viewer benchmark (`make bench-viewer`, part of `make bench`): a synthetic store of 100,000 calls
(10,000 sessions of 10 turns, in 2,500 groups, with rewards) and one session of about 5,000
tokens, served by `rl-proxy ui` with the default model's tokenizer. Reports the server's time
for each page (median of 5) and, with Debian's chromium if installed, the time a real browser
takes to load and lay out the 5,000-token session (median of 3). The token ids are random (the
tokenizer's vocabulary), so the text is noise; the work per token is the same as for a real one."""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.bench_trajectories import session_calls
from proxy.server import AppThread
from recorder import SessionInfo, Store
from recorder.episodes import EpisodeOutcome
from trainer.viewer import create_app, token_decoder

VOCAB = 49_152  # SmolLM2's


async def fill(db: str, sessions: int, turns: int, long_turns: int) -> None:
    rng = random.Random(0)
    async with Store(db) as store:
        start = time.perf_counter()
        for i in range(sessions + 1):
            sid, n = (f"s{i}", turns) if i < sessions else ("long", long_turns)
            info = SessionInfo(id=sid, key=sid, run=f"run-{i % 4}", task_id=f"t{i % 50}", group_id=f"g{i // 4}")
            await store.resolve_session(info)
            await asyncio.gather(*(store.record(c) for c in session_calls(sid, n, rng, VOCAB)))
            await store.add_reward(sid, float(rng.random() < 0.4), "verifier")
            await store.end_session(sid, "ok", EpisodeOutcome(harness="ok"))  # a runner's episode
            if i % 1000 == 999:
                rate = (i + 1) * turns / (time.perf_counter() - start)
                print(f"\r  writing synthetic store: {(i + 1) * turns} calls, {rate:.0f} calls/s", end="", flush=True)
        print()


def median_time(work: Callable[[], object], times: int) -> float:
    spent = []
    for _ in range(times):
        start = time.perf_counter()
        work()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent)


def main(sessions: int, turns: int, long_turns: int) -> None:
    db = str(Path(tempfile.mkdtemp(prefix="rlp-bench-viewer-")) / "calls.db")
    asyncio.run(fill(db, sessions, turns, long_turns))
    pages = {
        "runs and the first page of sessions": "/",
        "sessions sorted by reward, descending": "/?sort=reward&desc=true",
        "sessions of one run and task": "/?run=run-1&task=t1",
        "page 100 of the sessions": "/?page=100",
        "a group of 4": "/groups/g7",
        "a 10-call session": "/sessions/s7",
        f"the {long_turns}-call session": "/sessions/long",
    }
    rows = []
    with AppThread(create_app(db, decode=token_decoder("default"))) as viewer, httpx.Client(timeout=60) as client:
        for name, path in pages.items():
            client.get(viewer.url + path).raise_for_status()  # the first: each token id decoded once
            size = len(client.get(viewer.url + path).content)
            rows.append((name, median_time(lambda p=path: client.get(viewer.url + p).raise_for_status(), 5), size))
        long_tokens = client.get(viewer.url + "/sessions/long").text.count('class="t')
        browser_s = browser_load(f"{viewer.url}/sessions/long") if shutil.which("chromium") else None
    print(f"\nViewer on a store of {sessions * turns + long_turns:,} calls ({sessions:,} sessions)\n")
    print("| page | server time (median of 5) | size |\n|---|---:|---:|")
    for name, seconds, size in rows:
        print(f"| {name} | {seconds * 1000:.0f} ms | {size / 1024:.0f} KiB |")
    if browser_s is None:
        print("\n(no chromium here: the browser's load time is not measured)")
    else:
        print(
            f"\nthe {long_tokens:,}-token session in headless Chromium (load and layout, median of 3): "
            f"{browser_s * 1000:.0f} ms"
        )


def browser_load(url: str) -> float:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"))
        page = browser.new_page()
        # Until the page is loaded and laid out: the last token's box is known.
        seconds = median_time(
            lambda: (page.goto(url, wait_until="load"), page.locator(".tokens .t").last.bounding_box()), 3
        )
        browser.close()
    return seconds


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--long-turns", type=int, default=60, help="turns of the long session (~81 tokens each)")
    args = parser.parse_args()
    main(args.sessions, args.turns, args.long_turns)
