"""Prometheus metrics of one proxy app, in a registry of its own (no global state). The workers
of `rl-proxy serve --workers N` keep theirs in files of one directory (prometheus_client's
multiprocess mode, chosen by `PROMETHEUS_MULTIPROC_DIR` before the import), and whichever worker
answers `/metrics` sums them all."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

SHARED = "PROMETHEUS_MULTIPROC_DIR"

WAITS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30)


class Metrics:
    def __init__(self, shared: bool = False) -> None:
        """`shared`: a worker's, whose counts are summed with the others'."""
        self.shared = shared
        if shared:
            _forget_dead(os.environ[SHARED])
        self.registry = CollectorRegistry()
        self.calls = Counter("rlp_calls", "Model calls handled", ["api", "status"], registry=self.registry)
        self.tokens = Counter("rlp_tokens", "Tokens recorded", ["kind"], registry=self.registry)
        self.errors = Counter("rlp_errors", "Calls that failed, by cause", ["cause"], registry=self.registry)
        self.latency = Histogram(
            "rlp_call_latency_seconds",
            "Latency of model calls through the proxy",
            ["api"],
            buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        # Where a call's time goes besides the upstream: token-in's renderings and the durable commit.
        self.token_in = Histogram(
            "rlp_token_in_seconds",
            "Time token-in took to plan a chat call's prompt: the upstream's /tokenize renderings, "
            "threads read back from the store",
            ["outcome"],  # continued (a thread's tokens), new_thread
            buckets=WAITS,
            registry=self.registry,
        )
        self.commit = Histogram(
            "rlp_commit_seconds",
            "Time a call's record took to commit to the store (its answer leaves after)",
            buckets=WAITS,
            registry=self.registry,
        )
        # Summed over the live workers, each as of its last call or scrape.
        self.queue_depth = Gauge(
            "rlp_recorder_queue_depth",
            "Writes waiting for the recorder",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.record_failures = Gauge(
            "rlp_record_failures",
            "Writes the recorder could not commit",
            registry=self.registry,
            multiprocess_mode="livesum",
        )

    def render(self) -> bytes:
        if not self.shared:
            return generate_latest(self.registry)
        every = CollectorRegistry()
        multiprocess.MultiProcessCollector(every)
        return generate_latest(every)

    def close(self) -> None:
        """This process's live gauges leave the sums (its counts stay in them)."""
        if self.shared:
            multiprocess.mark_process_dead(os.getpid())


def _forget_dead(directory: str) -> None:
    """The live gauges of workers that died without closing (killed, crashed) leave the sums."""
    for path in Path(directory).glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, directory)
        except PermissionError:  # alive, another user's
            pass
