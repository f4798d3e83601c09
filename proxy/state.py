"""What one proxy app holds while it runs: settings, store, upstreams, metrics (app.state.rlp)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.metrics import Metrics
from proxy.settings import Settings
from proxy.upstream import Upstreams
from recorder import CallRecord, Store


@dataclass
class ProxyState:
    settings: Settings
    store: Store
    upstreams: Upstreams
    metrics: Metrics = field(default_factory=Metrics)

    def observe(self, call: CallRecord) -> None:
        m = self.metrics
        m.calls.labels(call.api, "ok" if call.ok else "failed").inc()
        if not call.ok:
            m.errors.labels(str(call.http_status)).inc()
        m.tokens.labels("prompt").inc(len(call.prompt_token_ids))
        m.tokens.labels("completion").inc(sum(len(c.token_ids) for c in call.completions))
        m.latency.labels(call.api).observe(call.latency_ms / 1000.0)
