"""The store of recorded calls: sessions, calls with exact token ids and logprobs, rewards.

The proxy writes through `Store.record`; the trainer and the CLI read through the plain query
functions of `Store`. Nothing here knows HTTP or any model API.
"""

from recorder.records import CallRecord, Completion, SessionInfo
from recorder.store import Store

__all__ = ["CallRecord", "Completion", "SessionInfo", "Store"]
