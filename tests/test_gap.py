"""The swap's gap as a client sees it: the probe follows the host's state file from the old server
to the next one, and only the server that ends up serving ends the gap."""

from __future__ import annotations

import json
import time

import pytest

from tasks.vllm.gap import GapProbe
from testkit.openai_server import StreamingServer

pytestmark = pytest.mark.quiet  # measures speed: runs alone, before the parallel part (Makefile)


def _record(state_file, server: StreamingServer | None) -> int | None:
    """The host's state file naming `server` (its child process stands in for a vLLM group)."""
    if server is None:
        state_file.write_text("{}")
        return None
    pgid = server._child.pid
    state_file.write_text(json.dumps({"pgid": pgid, "base_url": server.base_url,
                                      "command": ["vllm", "--served-model-name", "fake"]}))
    return pgid


def test_the_gap_runs_from_the_old_servers_last_answer_to_the_serving_ones_first(tmp_path):
    state = tmp_path / "server.json"
    old = StreamingServer().__enter__()
    old_pgid = _record(state, old)
    with GapProbe(state, interval_s=0.1) as probe:
        time.sleep(0.5)
        old.__exit__()  # the old server stops
        stopped = time.time()
        time.sleep(1.0)
        with StreamingServer() as failed:  # a new server answers for a while, then fails its check
            failed_pgid = _record(state, failed)
            time.sleep(0.5)
        _record(state, None)
        time.sleep(0.5)
        with StreamingServer() as restored:
            restored_pgid = _record(state, restored)
            probe.wait_for_answer(restored_pgid)
            answered = time.time()
            rolled_back = probe.gap(old_pgid=old_pgid, new_pgid=restored_pgid)
            promoted = probe.gap(old_pgid=old_pgid, new_pgid=failed_pgid)
    # The failed server's answers do not end a gap that the restored server ends.
    assert abs(rolled_back.seconds - (answered - stopped)) < 0.35, (rolled_back, answered - stopped)
    assert rolled_back.seconds > 2.0 and rolled_back.failed >= 10
    assert 0.9 < promoted.seconds < 1.5  # had the failed one been promoted, its first answer ended the gap
    assert "s without an answer" in rolled_back.text()
    nothing = probe.gap(old_pgid=old_pgid, new_pgid=None)
    # Paused, it sends nothing: the benchmark of a promoted server gets no load it did not ask for.
    with StreamingServer() as quiet:
        state_pgid = _record(state, quiet)
        with GapProbe(state, interval_s=0.05) as paused:
            paused.wait_for_answer(state_pgid)
            paused.pause()
            time.sleep(0.1)
            count = len(paused.answers)
            time.sleep(0.5)
            assert len(paused.answers) == count
            paused.resume()
            time.sleep(0.3)
            assert len(paused.answers) > count
    assert nothing.seconds is None and nothing.text().startswith("nothing has answered since")
