"""`rl-proxy ui`: a tool-using session recorded through the proxy on the real vLLM, drawn token by
token in headless Chromium (Debian's, driven by Playwright); and the session list's filters,
sorting and pages, and the admin token rules, on a store of many sessions."""

from __future__ import annotations

import asyncio
import base64
import html
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest
from openai import OpenAI

from benchmarks.support.samples import ADD_TOOL
from benchmarks.support.sessions import tool_session
from benchmarks.support.stack import RunningProxy, Upstream
from proxy.server import AppThread
from recorder import CallRecord, Completion, SessionInfo, Store
from recorder.episodes import EpisodeOutcome
from recorder.graph import build_sequences
from recorder.records import LearnerView
from trainer.viewer import PAGE, create_app, token_decoder

EXAMPLES = Path(__file__).resolve().parents[2] / "harness_adapters" / "examples"
T0 = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_tool_session_is_drawn_token_by_token_in_a_real_browser(
    proxy: RunningProxy, vllm: Upstream, tmp_path: Path, chromium: str
) -> None:
    from playwright.sync_api import sync_playwright

    key = "run=viewer,task=add,group=g1,id=viewer-1"
    tool_session(proxy.v1, key, vllm.model)
    # A fourth call whose history was edited: it starts a thread of its own, its prefix diverging.
    OpenAI(base_url=proxy.v1, api_key=key, max_retries=0).chat.completions.create(
        model=vllm.model,
        messages=[{"role": "user", "content": "Add 2 and 4 with the add tool."}],
        tools=[ADD_TOOL],
        max_tokens=8,
        temperature=0,
    )
    [session] = [s for s in proxy.sessions() if s.id == "viewer-1"]
    report = build_sequences(proxy.calls("viewer-1"), session)
    # The edited call's thread, whatever the model made of the first three.
    [edited] = [i for i, q in enumerate(report.sequences) if q.spans[0].seq == 4]
    [why] = [b.reason for b in report.breaks if b.seq == 4]
    assert why == "prefix diverges"

    app = create_app(proxy.db, runs=EXAMPLES, decode=token_decoder("default"))
    with AppThread(app) as viewer, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{viewer.url}/")
        assert "viewer" in page.locator("#runs").inner_text()
        assert page.locator("svg.chart polyline").count() >= 4  # the arithmetic run's curves
        page.fill("input[name=run]", "viewer")  # the filter form, its other fields left empty
        page.click("button")
        page.wait_for_url("**/?run=viewer*")
        assert "1 found" in page.locator("h1").nth(1).inner_text()
        page.click("text=viewer-1")
        page.wait_for_url("**/session?id=viewer-1")
        for i, sequence in enumerate(report.sequences):
            drawn = page.locator(f"#seq-{i} .tokens .t")
            assert drawn.count() == len(sequence.input_ids)
            sampled = page.eval_on_selector_all(f"#seq-{i} .tokens .t.s", "ts => ts.map(t => +t.dataset.i)")
            assert sampled == [t for t, m in zip(sequence.input_ids, sequence.loss_mask, strict=True) if m]
        assert "prefix diverges" in page.locator(f"#seq-{edited} .break").inner_text()
        assert page.locator(f"#seq-{edited} .break .windows pre").count() == 2
        first, then = page.locator(f"#seq-{edited} .break .t.d").all_inner_texts()  # where they part: "3" against "4"
        assert first.strip() == "3" and then.strip() == "4"
        page.locator("#seq-0 .tokens .t.s").first.hover()
        assert "sampled token" in page.locator("#tok").inner_text()
        assert "logprob" in page.locator("#tok").inner_text()
        page.screenshot(path=str(tmp_path / "session.png"), full_page=True)
        page.goto(f"{viewer.url}/groups/g1")
        assert page.locator(".episode").count() == 1 and "Not trained" in page.locator("main p").first.inner_text()
        browser.close()
    assert (tmp_path / "session.png").read_bytes()[:4] == b"\x89PNG"


def _store_of_many(db: str, n: int) -> None:

    async def fill() -> None:
        async with Store(db) as store:
            for i in range(n):
                run, group = f"run-{i % 2}", f"g{i // 4}"
                info = SessionInfo(id=f"s{i:03d}", key=f"k{i}", run=run, task_id=f"t{i % 5}", group_id=group)
                await store.resolve_session(info)
                await store.record(
                    CallRecord(
                        f"s{i:03d}",
                        1,
                        "openai.chat",
                        "m",
                        "u",
                        False,
                        {"messages": []},
                        {},
                        True,
                        200,
                        None,
                        [1, 2, 3],
                        [Completion(0, [4, 5], [-0.1, -2.0], "stop")],
                        "0",
                        "0",
                        T0,
                        T0,
                    )
                )
                await store.add_reward(f"s{i:03d}", (i % 4) / 3, "verifier")
                await store.end_session(f"s{i:03d}", "ok" if i % 3 else "failed", EpisodeOutcome(harness="ok"))
            # what the learner saw of s005's sequence at steps 1 and 2: the viewer shows the latest
            for step, lps in ((1, [-0.5, -0.5]), (2, [-0.25, -1.5])):
                await store.save_learner_views("run-1", step, [LearnerView("s005", 1, 0.75, lps)])
            # one that is not this sequence's (another length): not drawn
            await store.save_learner_views("run-0", 1, [LearnerView("s006", 1, 0.5, [-0.3])])

    asyncio.run(fill())


def test_sessions_filtered_sorted_and_paged_and_groups_with_advantages(tmp_path: Path) -> None:
    db = str(tmp_path / "many.db")
    _store_of_many(db, 120)
    runs = tmp_path / "runs"
    (runs / "live").mkdir(parents=True)
    (runs / "live" / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5, "rollout_reward": 0.4}\n{"step": 2, "rew')
    app = create_app(db, runs, decode=lambda ids: [f"<{i}>" for i in ids])
    with AppThread(app) as viewer:
        get = httpx.Client(base_url=viewer.url).get
        first = get("/").text
        assert "120 found" in first and "page 1 of 3" in first and first.count('href="/session?id=') == PAGE
        last = get("/", params={"page": 2}).text
        assert last.count('href="/session?id=') == 120 - 2 * PAGE and "s119" in last and "s000" not in last
        best = get("/", params={"run": "run-1", "min_reward": 1, "sort": "created", "desc": "true"}).text
        # run-1 holds the odd sessions, reward 1 every fourth: s003, s007, ... s119, newest first
        assert "30 found" in best and best.index("s119") < best.index("s115")
        failed = get("/", params={"status": "failed", "task": "t0"}).text
        assert "8 found" in failed  # i % 3 == 0 and i % 5 == 0: every 15th of 120
        assert first.count("<polyline") == 2  # the live run's finished line, its half-written one left out
        assert get("/", params={"sort": "nonsense"}).status_code == 422
        assert get("/", params={"page": 10**20}).status_code == 422
        assert get("/sessions/nobody").status_code == 404
        page = get("/sessions/s005").text
        assert 'class="t s"' in page and "&lt;4&gt;" in page and "verifier" in page
        assert "episode outcome: the harness ran" in page
        # each call's place in the session graph, and the episode's capture grade
        assert _cells(page, "place")[:1] == ["new"] and 'class="grade-' in page
        assert '<ul class="graph"><li><b class="edge">new</b>' in page  # its graph: one sequence here
        # the learner's logprobs beside the behaviour ones (-0.1 and -2.0), and the advantage
        assert 'data-l="-0.1000" data-v="0" data-c="1" data-q="-0.2500"' in page and "--m:0.150" in page
        assert 'data-l="-2.0000" data-v="0" data-c="1" data-q="-1.5000"' in page and "--m:0.500" in page
        assert "the learner saw it at step 2, advantage 0.750" in page and "--ah:120; --as:0.750" in page
        assert 'data-q="' not in get("/sessions/s006").text and "the learner saw" not in get("/sessions/s006").text
        # s004-s007: rewards 0, 1/3, 2/3, 1, but s006 ended "failed" though its harness ran (its
        # verifier failed): the trainer leaves it out, and the advantages are those of the other three.
        group = get("/groups/g1").text
        assert _cells(group, "trained")[2].startswith("left out (no reward)")
        advantages = [float(a) for i, a in enumerate(_cells(group, "advantage")) if i != 2]
        assert advantages == pytest.approx([-0.873, -0.218, 1.091], abs=1e-3)


@pytest.mark.parametrize("odd", ["repo/issue#12 & more?", "x/../victim", ".."])
def test_ids_with_slashes_and_query_characters_link_to_their_pages(tmp_path: Path, odd: str) -> None:
    """Every link, resolved as a browser resolves it (dot segments too), opens its own page: a
    link that kept the '/' of `x/../victim` opened the session `victim`'s."""
    db = str(tmp_path / "odd.db")

    async def fill() -> None:
        async with Store(db) as store:
            await store.resolve_session(SessionInfo(id="victim", key="v", run="a&b"))
            await store.resolve_session(SessionInfo(id=odd, key="k", run="a&b", task_id="t", group_id=f"run/{odd}"))
            await store.record(
                CallRecord(
                    odd,
                    1,
                    "openai.chat",
                    "m",
                    "u",
                    False,
                    {},
                    {},
                    True,
                    200,
                    None,
                    [1],
                    [Completion(0, [2], [-0.5], "stop")],
                    "0",
                    "0",
                    T0,
                    T0,
                )
            )

    asyncio.run(fill())
    with AppThread(create_app(db, decode=lambda ids: [str(i) for i in ids])) as viewer:
        client = httpx.Client(base_url=viewer.url)
        index = client.get("/", params={"task": "t"}).text
        links = [
            part.split('"', 1)[0].replace("&amp;", "&")
            for part in index.split('href="')[1:]
            if part.startswith(("/session", "/group", "/?run"))
        ]
        assert len(links) == 3, links
        for link in links:
            shown = client.get(urljoin(f"{viewer.url}/", link))
            assert shown.status_code == 200 and html.escape(odd, quote=False) in shown.text, link


def _cells(html: str, name: str) -> list[str]:
    return [part.split("<", 1)[0] for part in html.split(f'class="{name}">')[1:]]


def test_off_loopback_the_viewer_asks_for_the_admin_token(tmp_path: Path) -> None:
    db = str(tmp_path / "one.db")
    _store_of_many(db, 1)
    # Bound to every address with a token: even this machine's own requests must bring it.
    app = create_app(db, decode=lambda ids: [str(i) for i in ids], host="0.0.0.0", admin_token="secret")
    with AppThread(app) as viewer:
        refused = httpx.get(f"{viewer.url}/sessions/s000")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        assert "admin token" in refused.text
        raw = httpx.get(f"{viewer.url}/", headers={"Authorization": "Basic secret"})  # not base64 of user:token
        assert raw.status_code == 401
        wrong = base64.b64encode(b"me:guess").decode()
        assert httpx.get(f"{viewer.url}/", headers={"Authorization": f"Basic {wrong}"}).status_code == 401
        right = base64.b64encode(b"me:secret").decode()
        assert httpx.get(f"{viewer.url}/sessions/s000", headers={"Authorization": f"Basic {right}"}).status_code == 200
        assert httpx.get(f"{viewer.url}/", headers={"Authorization": "Bearer secret"}).status_code == 200
