"""A typed client of the proxy's admin API (admin.py), for whatever runs episodes or swaps
weights from another process: sessions in and out as `SessionInfo`, an episode's end as an
`EpisodeOutcome`. Only the routes those callers use are here; the API itself is documented in
docs/proxy.md."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import httpx

from proxy.admin import SESSION, SessionCreate, SessionEnd
from recorder import SessionInfo
from recorder.episodes import EndStatus, EpisodeOutcome, Sampling


class AdminError(RuntimeError):
    """The admin API refused a request or could not be reached; the message says which and why."""


class AdminClient:
    """Use as `async with AdminClient(url, token) as admin`."""

    def __init__(self, url: str, token: str | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """`transport`: another way to the API than the network (a test's fault injection)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Connections idle for less than any server keeps them (uvicorn's default: 5 s).
        limits = httpx.Limits(keepalive_expiry=2.0)
        self.http = httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits, transport=transport)

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.http.aclose()

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            answer = await self.http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise AdminError(f"{method} {path}: the proxy could not be reached: {exc!r}") from exc
        if not answer.is_success:
            raise AdminError(f"{method} {path}: HTTP {answer.status_code}: {answer.text[:500]}")
        return answer.json()

    async def _session(self, method: str, path: str, body: dict[str, Any] | None = None) -> SessionInfo:
        found = await self._send(method, path, body)
        return SESSION.validate_python({"key": "", **found})

    async def create_session(
        self,
        *,
        run: str | None = None,
        task_id: str | None = None,
        group_id: str | None = None,
        policy_model: str | None = None,
        metadata: dict[str, Any] | None = None,
        sampling: Sampling | None = None,
    ) -> SessionInfo:
        """A new session, with its key (the API key its harness uses)."""
        asked = SessionCreate(
            run=run,
            task_id=task_id,
            group_id=group_id,
            policy_model=policy_model,
            metadata=metadata or {},
            sampling=sampling,
        )
        return await self._session("POST", "/admin/sessions", asked.model_dump(mode="json", exclude_none=True))

    async def session(self, session_id: str) -> SessionInfo:
        return await self._session("GET", f"/admin/sessions/{session_id}")

    async def add_reward(self, session_id: str, value: float, source: str, reward_id: str | None = None) -> None:
        """A reward for the session; posted again with the same `reward_id`, it counts once."""
        await self._send(
            "POST", f"/admin/sessions/{session_id}/reward", {"value": value, "source": source, "id": reward_id}
        )

    async def end_session(
        self, session_id: str, status: EndStatus, outcome: EpisodeOutcome | None = None
    ) -> SessionInfo:
        """End the session; the session as ended (its reward summed, its calls counted)."""
        ended = SessionEnd(status=status, outcome=outcome)
        return await self._session("POST", f"/admin/sessions/{session_id}/end", ended.model_dump(mode="json"))

    async def refresh_version(self) -> dict[str, str | None]:
        """Have the proxy read its upstreams' weight versions now: {upstream URL: version}."""
        found = await self._send("POST", "/admin/policy_version/refresh")
        return dict(found["versions"])
