"""Cancelling a redeploy from Prefect mid-sweep, as a worker would cancel it: the new server stops, and the
last good deployment serves again on its port."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import demo_answer, vllm_processes
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelling

from flows.demo import demo_config
from flows.deploy import deploy_model
from tasks.history.last_good import read_last_good
from tasks.orchestration.host_lock import LEASE_S, host_lock
from tasks.vllm.process import reap_stale, serving_group
from testkit.prefect_processes import free_port

pytestmark = pytest.mark.usefixtures("prefect_server")

SERVE = "from flows.deploy import deploy_model; deploy_model.serve(name='cancel-test')"


def _wait(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_cancel_mid_sweep_stops_the_new_server_and_the_last_good_serves_again(local_hub, tmp_path):
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    log = (tmp_path / "runner.log").open("wb")
    runner = subprocess.Popen([sys.executable, "-c", SERVE], env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    port = free_port()
    state = tmp_path / "models" / ".rollout" / "server.json"
    try:
        # A good deployment serving on a fixed port: what the cancelled redeploy must leave behind.
        deploy_model(demo_config(local_hub.endpoint, tmp_path / "models", port=port, concurrency_levels=[1],
                                 level_duration_s=1.0, keep_serving=True, under_load=False))
        good = serving_group(state)
        assert good is not None and demo_answer(port) == " 44 45 46"
        # A sweep long enough to be cancelled in the middle of it.
        config = demo_config(local_hub.endpoint, tmp_path / "models", requests_per_level=4000, port=port,
                             level_duration_s=None, output_len=64, keep_serving=True, under_load=False)
        with get_client(sync_client=True) as client:
            _wait(lambda: _has_deployment(client), 120, "the served deployment")
        run = run_deployment("deploy-model/cancel-test", parameters={"config": config.model_dump(mode="json")},
                             timeout=0, as_subflow=False)
        with get_client(sync_client=True) as client:
            _wait(lambda: _bench_running(client, run.id), 600, "the sweep to start")
            assert vllm_processes(), "vLLM serves during the sweep"
            client.set_flow_run_state(run.id, Cancelling(), force=True)
            final = _wait(lambda: (s := client.read_flow_run(run.id).state).is_final() and s, 120, "cancellation")
        assert final.is_cancelled(), final
        # The new server stopped and the last good one started again on its port: by the run itself
        # on SIGTERM, or, where the runner killed it first, by its swap's guard.
        _wait(lambda: demo_answer(port) == " 44 45 46", 300, "the last good deployment to answer again")
        # Its restorer records it in last-good.json once its start is checked, a moment after it
        # first answers (a loaded machine has made that moment seconds).
        _wait(lambda: read_last_good(tmp_path / "models" / ".rollout").serving_pgid == serving_group(state), 60,
              "last-good.json to name the restored server")
        assert serving_group(state) not in (None, good)
        assert len({group for group in map(_pgid, vllm_processes())}) == 1  # one server, no orphan
        # The cancelled run gave the host back, at the latest when its lease lapsed (the runner
        # kills a flow process that does not exit in its grace period): the next deploy may start.
        with host_lock(wait_s=LEASE_S + 30):
            pass
    finally:
        reap_stale(state)
        os.killpg(runner.pid, 15)
        runner.wait(timeout=30)
    assert vllm_processes() == []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _has_deployment(client) -> bool:
    try:
        client.read_deployment_by_name("deploy-model/cancel-test")
        return True
    except Exception:
        return False


def _bench_running(client, flow_run_id) -> bool:
    state = client.read_flow_run(flow_run_id).state
    assert not state.is_final(), f"the flow run ended before it could be cancelled: {state}"
    runs = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="bench c=")),
    )
    return any(r.state and r.state.is_running() for r in runs)
