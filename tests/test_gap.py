"""The swap's gap as a client sees it: the probe follows the host's state file from the old server
to the next one, and only the server that ends up serving ends the gap."""

from __future__ import annotations

import json
import time

import pytest

from tasks.vllm.gap import GapProbe
from testkit.json_reply import send_json
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


class _Answering:
    """A one-route completions server whose answer and delay the test sets: what vLLM sends while it
    shuts down (an aborted request) or a reply that arrives after the host's record moved on."""

    def __init__(self, body: dict, delay_s: float = 0.0):
        import http.server
        import threading

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(outer.delay_s)
                send_json(self, outer.body)

            def log_message(self, *args):
                pass

        self.body, self.delay_s = body, delay_s
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def _state(state_file, base_url: str, pgid: int) -> None:
    state_file.write_text(json.dumps({"pgid": pgid, "base_url": base_url, "command": ["vllm", "--served-model-name", "m"]}))


def _choice(finish_reason: str, tokens: int) -> dict:
    return {"choices": [{"index": 0, "text": " 2" if tokens else "", "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": 1 + tokens}}


def test_an_aborted_request_is_not_an_answer_and_a_reply_after_the_record_moved_is_nobodys(tmp_path):
    state = tmp_path / "server.json"
    aborting = _Answering(_choice("abort", 0))  # a server shutting down: 200, no token
    answering = _Answering(_choice("length", 1), delay_s=0.4)
    try:
        _state(state, aborting.base_url, 1001)
        with GapProbe(state, interval_s=0.05) as probe:
            time.sleep(0.5)
        assert probe.answers and not any(a.ok for a in probe.answers)
        assert {a.outcome for a in probe.answers} == {"no token (abort)"}
        # Every probe lands in the run's record of the swap, next to the state file.
        saved = [json.loads(line) for line in (tmp_path / "gap-probe.jsonl").read_text().splitlines()]
        assert len(saved) == len(probe.answers) and saved[0]["pgid"] == 1001

        _state(state, answering.base_url, 1002)
        with GapProbe(state, interval_s=0.05) as probe:
            probe.wait_for_answer(1002)
            time.sleep(0.1)  # a probe in flight now, answered 0.4 s later
            _state(state, answering.base_url, 1003)  # the host records another server meanwhile
            probe.wait_for_answer(1003)
        moved = [a for a in probe.answers if a.outcome == "moved"]
        assert moved and not any(a.ok for a in moved)  # neither 1002's nor 1003's answer
        assert any(a.ok and a.pgid == 1003 for a in probe.answers)
    finally:
        aborting.close()
        answering.close()
