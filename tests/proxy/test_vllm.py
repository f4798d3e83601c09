"""Launching vLLM: clear errors when it cannot start, and nothing left running."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy.vllm import BackendError, VllmServer

pytestmark = pytest.mark.slow


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_model_vllm_cannot_load_is_a_clear_error(tmp_path: Path) -> None:
    """And the folder of vLLM's sockets goes with it (test_serve.py: none is left in the temp dir)."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    server = VllmServer(str(empty), "broken", log_file=tmp_path / "vllm.log")
    with pytest.raises(BackendError, match="exited with code") as info:
        server.start(timeout=300)
    assert str(tmp_path / "vllm.log") in str(info.value)
    assert "not-a-model" in str(info.value)  # the end of vLLM's log comes with the error
    assert server.sockets is not None and not server.sockets.exists()


def test_no_start_in_time_is_a_clear_error_and_the_process_is_stopped(tmp_path: Path) -> None:
    server = VllmServer(str(tmp_path), "slow", log_file=tmp_path / "vllm.log")
    with pytest.raises(BackendError, match="did not start within 1 s"):
        server.start(timeout=1)
    assert server.process is not None and _gone(server.process.pid)
