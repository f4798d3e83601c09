"""`rl-proxy ui`: a read-only viewer of a store in the browser. `/` lists runs (with their
training curves, from the metrics.jsonl files under `--runs`) and sessions (filtered, sorted
and paged in SQL); `/sessions/{id}` draws the session as its graph (recorder/graph.py:
sequences, the subagents, compactions, forks and retries that branch from them) and every
training sequence built from its trained calls token by token (prompt and tool tokens apart
from sampled ones, each sampled token shaded by its behaviour logprob), marks where a thread
started and why, and shows each call's request and answer as the client's API had them;
`/groups/{id}` sets a GRPO group's episodes side by side with their rewards and advantages.
Server-rendered (Jinja2) with a little JavaScript, nothing fetched from elsewhere. Off
loopback, or behind a forwarder, it asks for the admin token as the proxy's admin API does (a
browser sends it as the password of basic auth).

It sits in the trainer package because it shows what the trainer trains on: a group's rewards
and advantages are those the trainer stored when it took the group, or, before that, what the
one rule (recorder/episodes.py) gives with the run's stored settings (trainer/groups.py).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlencode

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from markupsafe import Markup
from pydantic import BeforeValidator

from proxy.admin import check_admin
from proxy.errors import Unauthorized
from proxy.settings import Settings
from recorder.errors import StoreError, StoreValueError
from recorder.graph import branches
from recorder.records import LearnerView
from recorder.store import Store
from recorder.trajectories import WINDOW, TrainingSequence
from recorder.validation import check
from trainer.groups import group_view
from trainer.loop import read_metrics

HERE = Path(__file__).parent
PAGE = 50  # sessions a page
Decode = Callable[[list[int]], list[str]]
# A query parameter the filter form sends empty when it is not filled in.
Bound = Annotated[float | None, BeforeValidator(lambda value: value or None)]


def token_decoder(model: str) -> Decode:
    """Each token id's own text, from the model's tokenizer (each id decoded once, then cached)."""
    from transformers import AutoTokenizer

    from proxy.model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model)[0])
    known: dict[int, str] = {}

    def decode(ids: list[int]) -> list[str]:
        new = sorted({i for i in ids if i not in known})
        if new:
            known.update(zip(new, tokenizer.batch_decode([[i] for i in new]), strict=True))
        return [known[i] for i in ids]

    return decode


def tokens(
    sequence: TrainingSequence, decode: Decode, learner: list[float] | None = None
) -> list[tuple[int, str, bool, float, str, int, float | None]]:
    """(id, text, sampled, behaviour logprob, policy version, call, learner logprob) of every
    token of a sequence; the learner's (a LearnerView's, one per trained token) where stored."""
    span_of: dict[int, tuple[str, int]] = {}
    for span in sequence.spans:
        for i in range(span.start, span.end):
            span_of[i] = (span.version or "-", span.seq)
    seen = iter(learner or [])
    return [
        (token, text, bool(mask), logprob, *span_of.get(i, ("", 0)), next(seen, None) if mask else None)
        for i, (token, text, mask, logprob) in enumerate(
            zip(sequence.input_ids, decode(sequence.input_ids), sequence.loss_mask, sequence.logprobs, strict=True)
        )
    ]


def chart(title: str, series: dict[str, list[tuple[float, float]]], unit: Literal["", "%"] = "") -> Markup:
    """A line chart as inline SVG: one polyline a series, over a shared step axis."""
    points = [p for line in series.values() for p in line]
    if not points:
        return Markup("")
    width, height, pad = 420, 180, 34
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(0.0, *(p[1] for p in points)), max(1.0, *(p[1] for p in points))
    sx = (width - 2 * pad) / ((x1 - x0) or 1)
    sy = (height - 2 * pad) / ((y1 - y0) or 1)

    def xy(p: tuple[float, float]) -> tuple[float, float]:
        return round(pad + (p[0] - x0) * sx, 1), round(height - pad - (p[1] - y0) * sy, 1)

    def label(v: float) -> str:
        return f"{v:.0%}" if unit == "%" else f"{v:g}"

    colours = ["#2563eb", "#dc2626", "#16a34a", "#9333ea"]
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img"><title>{Markup.escape(title)}</title>',
        f'<text x="{pad}" y="14" class="ct">{Markup.escape(title)}</text>',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" class="ax"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" class="ax"/>',
        f'<text x="2" y="{height - pad}" class="cl">{label(y0)}</text>',
        f'<text x="2" y="{pad + 4}" class="cl">{label(y1)}</text>',
        f'<text x="{pad}" y="{height - pad + 14}" class="cl">step {x0:g}</text>',
        f'<text x="{width - pad}" y="{height - pad + 14}" class="cl" text-anchor="end">{x1:g}</text>',
    ]
    for k, (name, line) in enumerate(series.items()):
        colour = colours[k % len(colours)]
        if line:
            at = [xy(p) for p in line]
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.8" '
                f'points="{" ".join(f"{x},{y}" for x, y in at)}"/>'
            )
            parts += [f'<circle cx="{x}" cy="{y}" r="2.2" fill="{colour}"/>' for x, y in at if len(at) < 40]
        parts.append(
            f'<text x="{pad + 150 * k}" y="{height - 4}" class="cl" fill="{colour}">'
            f"&#9632; {Markup.escape(name)}</text>"
        )
    return Markup("".join(parts) + "</svg>")


def run_charts(runs: Path | None) -> list[tuple[str, Markup, Markup]]:
    """(run directory, reward chart, held-out success chart) of each metrics.jsonl under `runs`."""
    if runs is None:
        return []
    found = []
    for metrics in sorted([runs / "metrics.jsonl", *runs.glob("*/metrics.jsonl")]):
        if not metrics.is_file():
            continue
        steps, evals = read_metrics(metrics)
        rewards = chart(
            "reward per step",
            {
                "rollouts": [(r["step"], r["rollout_reward"]) for r in steps if r.get("rollout_reward") is not None],
                "trained groups": [(r["step"], r["reward"]) for r in steps],
            },
        )
        success = chart(
            "held-out success",
            {
                "sampled": [(r["step"], r["heldout_success"]) for r in evals],
                "greedy": [(r["step"], r["heldout_success_greedy"]) for r in evals if "heldout_success_greedy" in r],
            },
            unit="%",
        )
        found.append((str(metrics.parent.relative_to(runs) if metrics.parent != runs else runs.name), rewards, success))
    return found


def create_app(
    db: str,
    runs: Path | None = None,
    decode: Decode | None = None,
    host: str = "127.0.0.1",
    admin_token: str | None = None,
) -> FastAPI:
    """The viewer of the store at `db`; `decode` gives each token id's text (default: the default
    model's tokenizer); `host` and `admin_token` decide who may look, as for the proxy."""
    settings = Settings(db=db, host=host, admin_token=admin_token)
    store = Store(db, readonly=True)
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.globals["fmt"] = lambda v, spec=".3f": "-" if v is None else format(v, spec)
    # Links carry ids in the query: in a path, a '/' in an id (or an id that is '..') is a dot
    # segment the browser resolves, and a link to `x/../victim` opened another session's page.
    templates.env.filters["query"] = lambda value: urlencode({"id": value})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with store:
            app.state.decode = decode or token_decoder("default")
            yield

    app = FastAPI(title="rl-proxy viewer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.exception_handler(StoreError)
    async def store_failed(request: Request, exc: StoreError) -> Response:
        status = 400 if isinstance(exc, StoreValueError) else 503
        return PlainTextResponse(f"the store could not answer: {exc}", status)

    @app.middleware("http")
    async def admin_only(request: Request, call_next: Callable[[Request], Any]) -> Response:
        try:
            check_admin(request, settings, basic=True)
        except Unauthorized as exc:
            return PlainTextResponse(exc.message, 401, headers={"WWW-Authenticate": 'Basic realm="rl-proxy"'})
        response: Response = await call_next(request)
        return response

    @app.get("/", response_class=HTMLResponse)
    async def index(
        request: Request,
        run: str | None = None,
        task: str | None = None,
        group: str | None = None,
        status: str | None = None,
        min_reward: Bound = None,
        max_reward: Bound = None,
        sort: Literal["created", "reward", "calls", "run", "task", "status"] = "created",
        desc: bool = False,
        page: int = Query(0, ge=0, le=1_000_000),
    ) -> Response:
        filters: dict[str, Any] = {
            "run": run or None,
            "task_id": task or None,
            "group_id": group or None,
            "status": status or None,
            "min_reward": min_reward,
            "max_reward": max_reward,
        }
        sessions = await store.list_sessions(**filters, sort=sort, descending=desc, offset=page * PAGE, limit=PAGE)
        total = await store.count_sessions(**filters)
        query = {k: v for k, v in request.query_params.items() if k != "page" and v != ""}
        return templates.TemplateResponse(
            request,
            "index.html",
            {
                "runs": await store.runs(),
                "charts": run_charts(runs),
                "sessions": sessions,
                "total": total,
                "page": page,
                "pages": max(1, math.ceil(total / PAGE)),
                "query": query,
                "sort": sort,
                "desc": desc,
            },
        )

    @app.get("/session", response_class=HTMLResponse)
    async def session_by_query(request: Request, id: str) -> Response:
        return await session(request, id)

    @app.get("/sessions/{session_id:path}", response_class=HTMLResponse)
    async def session(request: Request, session_id: str) -> Response:
        info = await store.get_session(session_id)
        if info is None:
            return PlainTextResponse(f"no session {session_id!r} in this store", 404)
        calls = [c async for c in store.iter_calls(session_id)]
        checked = check(calls, info, call_rewards=await store.call_rewards(session_id))
        # the sequences of the calls the graph places to be trained (the trainer also keeps one
        # choice of an n > 1 call)
        report = checked.graph.trained
        breaks = {b.seq: b for b in report.breaks}
        decode = request.app.state.decode
        # What the learner saw, where it is this sequence's: one view per first call, so not for
        # the choices of an n > 1 call (they share it), nor one of other length (a masked one).
        firsts = Counter(q.spans[0].seq for q in report.sequences if q.spans)
        found = await store.learner_views(session_id)

        def view_of(q: TrainingSequence) -> tuple[int, LearnerView] | None:
            view = found.get(q.spans[0].seq) if q.spans and firsts[q.spans[0].seq] == 1 else None
            return view if view and len(view[1].logprobs) == q.sampled_tokens else None

        sequences = []
        for q in report.sequences:
            view = view_of(q)
            brk = breaks.get(q.spans[0].seq) if q.spans else None
            sequences.append((q, tokens(q, decode, view[1].logprobs if view else None), brk, view))
        # Each side's window, and where in it the two first differ.
        windows = {
            b.seq: (decode(b.expected), decode(b.found), min(b.at or 0, WINDOW))
            for b in report.breaks
            if b.expected or b.found
        }
        return templates.TemplateResponse(
            request,
            "session.html",
            {
                "s": info,
                "calls": calls,
                "report": report,
                "sequences": sequences,
                "windows": windows,
                "rewards": await store.rewards(session_id),
                "graph": {p.seq: p for p in checked.placements},
                "tree": branches(checked.placements),
                "sequence_of": {span.seq: i for i, q in enumerate(report.sequences) for span in q.spans},
                "grade": checked.grade,
                "as_json": _as_json,
            },
        )

    @app.get("/group", response_class=HTMLResponse)
    async def group_by_query(request: Request, id: str) -> Response:
        return await group(request, id)

    @app.get("/groups/{group_id:path}", response_class=HTMLResponse)
    async def group(request: Request, group_id: str) -> Response:
        view = await group_view(store, group_id)
        if view is None:
            return PlainTextResponse(f"no group {group_id!r} in this store", 404)
        decode, episodes = request.app.state.decode, []
        for s, reward, advantage, why in view.episodes:
            calls = [c async for c in store.iter_calls(s.id)]
            last = next((c for c in reversed(calls) if c.completions), None)
            answer = "".join(decode(last.completions[0].token_ids)) if last else ""
            episodes.append((s, reward, why, advantage, answer))
        return templates.TemplateResponse(
            request, "group.html", {"group": group_id, "episodes": episodes, "view": view}
        )

    return app


def _as_json(value: Any) -> str:
    return json.dumps(value, indent=1, ensure_ascii=False, default=str)
