"""The one serving path (tasks/serving.py): who stops the server, and when. A real process group
stands in for vLLM; the sweep runs against plain functions."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tasks.bench.spec import BenchSpec
from tasks.serving import Serving
from tasks.vllm.process import ServerHandle, group_members
from testkit.levels import level_result

pytestmark = pytest.mark.quiet  # measures speed: runs alone, before the parallel part (Makefile)


def _server(tmp_path) -> ServerHandle:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    state = tmp_path / "server.json"
    state.write_text("{}")
    return ServerHandle(pid=proc.pid, pgid=proc.pid, base_url="http://127.0.0.1:9/v1", log_path=tmp_path / "log",
                        state_file=state, command=["sleep"], process=proc)


def test_an_owned_server_is_stopped_when_the_block_ends_unless_kept(tmp_path):
    stopped = []
    with Serving(start=lambda: _server(tmp_path), stop=stopped.append) as serving:
        assert group_members(serving.handle.pgid)
    assert stopped == [serving.handle]  # the caller's stop (a task in the deploy flow)
    kept = _server(tmp_path)
    with Serving(handle=kept, keep_serving=True, stop=stopped.append):
        pass
    assert stopped == [serving.handle] and group_members(kept.pgid)  # it goes on serving
    kept.process.kill()


@pytest.mark.parametrize("error", [RuntimeError("answer check failed"), KeyboardInterrupt()])
def test_an_error_stops_the_server_at_once_even_one_to_keep(tmp_path, error):
    handle = _server(tmp_path)
    with pytest.raises(type(error)):
        with Serving(handle=handle, keep_serving=True, stop=lambda h: pytest.fail("not through the caller's stop")):
            raise error
    assert not group_members(handle.pgid) and not handle.state_file.exists()


def test_a_server_someone_else_runs_is_swept_and_never_stopped():
    spec = BenchSpec(concurrency_levels=[1, 2, 4, 8], min_throughput_gain=0.1)
    speeds = {1: 100.0, 2: 190.0, 4: 200.0, 8: 150.0}
    with Serving(base_url="http://gpu-host:8000") as serving:
        swept = serving.sweep(spec, lambda c: level_result(c, speeds[c]))
    assert serving.handle is None and serving.base_url == "http://gpu-host:8000"
    assert [r.concurrency for r in swept.rows] == [1, 2, 4]  # +5% from 2 to 4: the sweep stops there
    assert swept.stop and swept.single_stream.concurrency == 1 and swept.knee.concurrency == 4
