"""The store of recorded calls: sessions, calls with exact token ids and logprobs, rewards.

The proxy writes through `Store.record`; the trainer and the CLI read through the plain query
functions of `Store`. trajectories.py rebuilds training sequences from calls, export.py and
report.py read them out, paths.py says where data goes by default, cli.py is `sessions`,
`report` and `export`. The bottom of the import order: it imports none of the other packages,
and nothing here knows HTTP or any model API.
"""

from recorder.records import CallRecord, Completion, SessionInfo
from recorder.store import Store

__all__ = ["CallRecord", "Completion", "SessionInfo", "Store"]
