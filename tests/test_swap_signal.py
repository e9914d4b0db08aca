"""A SIGTERM that reaches a redeploy at the very start of its swap, as Prefect delivers it to the
flow (TerminationSignal): just before the old server's stop, it leaves that server untouched and
serving; inside the stop, the stop is finished and the last good deployment brought back. Found by
hand: a SIGTERM inside the stop once left the host serving nothing, restored by no one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import artifact, demo_answer
from prefect.settings import PREFECT_API_URL

from flows.demo import demo_config
from flows.deploy import deploy_model
from tasks.history.last_good import read_last_good
from tasks.vllm.process import reap_stale, serving_group
from testkit.prefect_processes import free_port

pytestmark = pytest.mark.usefixtures("prefect_server")


def _held(gate: Path) -> list[int]:
    """Processes still waiting at this gate."""
    held = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(gate).encode() in (proc / "cmdline").read_bytes():
                held.append(int(proc.name))
        except OSError:
            pass
    return held


# The redeploy in its own process, with a real SIGTERM sent to itself at the moment named: Prefect
# turns it into TerminationSignal in the flow and, after the flow's handling, exits 143.
REDEPLOY = textwrap.dedent("""
    import os, signal, sys
    import flows.deploy
    from tasks.deployment.config import DeployConfig
    from tasks.vllm.gap import GapProbe

    where = sys.argv[1]
    if where == "before-the-stop":
        def terminated(self, pgid, timeout_s=5.0):
            os.kill(os.getpid(), signal.SIGTERM)
        GapProbe.wait_for_answer = terminated
    else:
        stop = flows.deploy.stop_serving
        def stopped_then_terminated(run_dir, what):
            stop.fn(run_dir, what)
            os.kill(os.getpid(), signal.SIGTERM)
        flows.deploy.stop_serving = stopped_then_terminated
    flows.deploy.deploy_model(DeployConfig.model_validate_json(sys.argv[2]))
""")


def _redeploy(config, where: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.run([sys.executable, "-c", REDEPLOY, where, config.model_dump_json()], env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_sigterm_before_the_old_servers_stop_leaves_it_serving_and_one_inside_the_stop_restores_it(
        local_hub, tmp_path):
    port = free_port()
    config = demo_config(local_hub.endpoint, tmp_path / "models", port=port, concurrency_levels=[1],
                         level_duration_s=1.0, keep_serving=True, under_load=False)
    state = config.run_dir / "server.json"
    try:
        deploy_model(config)
        good = serving_group(state)
        assert good is not None and demo_answer(port) == " 44 45 46"

        # Before the stop: while the swap waits for the old server's last answer.
        ended = _redeploy(config, "before-the-stop")
        assert ended.returncode == -signal.SIGTERM or ended.returncode == 143, ended.stderr[-3000:]
        assert serving_group(state) == good and demo_answer(port) == " 44 45 46"  # untouched
        assert artifact("deploy-demo-tiny-moe").data.splitlines()[0].endswith("keeps serving")
        assert not _held(config.run_dir / "vllm.gate")  # the prestarted vLLM was ended, not left waiting

        # Inside the stop: the old server is stopped, then the signal lands.
        ended = _redeploy(config, "inside-the-stop")
        assert ended.returncode == -signal.SIGTERM or ended.returncode == 143, ended.stderr[-3000:]
        back = serving_group(state)
        assert back not in (None, good) and demo_answer(port) == " 44 45 46", ended.stderr[-3000:]
        assert read_last_good(config.run_dir).serving_pgid == back  # the last good, started again
        assert "Rolled back" in artifact("deploy-demo-tiny-moe").data.splitlines()[0]
    finally:
        reap_stale(state)
