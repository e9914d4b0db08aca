"""A server that dies mid-sweep is named as dead, not as its symptom (issue 40, item 4): the sweep's
level fails with "every request failed ... ReadError", and the run says the server died, how (the
signal from its process), and where its log ends. A real streaming server is killed -9 while a real
level runs against it; no vLLM."""

from __future__ import annotations

import signal
import threading

import pytest

from tasks.bench.load import run_level
from tasks.bench.spec import BenchSpec
from tasks.bench.sweep import unusable_level
from tasks.errors import BenchmarkFailed, ServerDied
from tasks.serving import Serving
from tasks.vllm.process import ServerHandle
from testkit.openai_server import StreamingServer


def test_a_server_killed_mid_sweep_is_named_by_its_death_and_its_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO Application startup complete.\nINFO 127.0.0.1 \"POST /v1/completions HTTP/1.1\" 200 OK\n")
    spec = BenchSpec(concurrency_levels=[2], level_duration_s=2.0, input_len=8, output_len=16)
    with StreamingServer(itl_s=0.01) as server:
        handle = ServerHandle(pid=server._child.pid, pgid=server._child.pid, base_url=server.base_url, log_path=log,
                              state_file=tmp_path / "server.json", command=["fake"], process=server._child)
        killer = threading.Timer(0.3, server._child.send_signal, [signal.SIGKILL])
        with pytest.raises(ServerDied) as died, Serving(handle=handle, keep_serving=True) as serving:
            killer.start()
            rows = serving.sweep(spec, lambda c: run_level(serving.base_url, "fake", spec, concurrency=c,
                                                           vocab_size=1000, tokenizer=None)).rows
            if failed := unusable_level(rows) or next((r for r in rows if r.failed), None):
                raise BenchmarkFailed(f"every request failed at concurrency {failed.concurrency}: "
                                      f"{failed.first_error}")
    message = str(died.value)
    assert message.startswith(f"the vLLM server at {server.base_url} died during the benchmark (killed by signal 9, "
                              "SIGKILL): every request failed at concurrency 2: "), message
    assert message.endswith("; its log ends: INFO 127.0.0.1 \"POST /v1/completions HTTP/1.1\" 200 OK")
    assert len(message.splitlines()) == 1 and "Application startup complete" in died.value.log_tail


def test_a_check_that_fails_on_a_live_server_stays_what_it_was(tmp_path):
    import subprocess
    import sys

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "vllm"], start_new_session=True)
    handle = ServerHandle(pid=alive.pid, pgid=alive.pid, base_url="http://127.0.0.1:9", log_path=tmp_path / "vllm.log",
                          state_file=tmp_path / "server.json", command=["fake"], process=alive)
    with pytest.raises(BenchmarkFailed) as failed, Serving(handle=handle, keep_serving=True):
        raise BenchmarkFailed("every request failed at concurrency 2: HTTP 400")
    assert type(failed.value) is BenchmarkFailed and alive.poll() is not None  # stopped, as before
