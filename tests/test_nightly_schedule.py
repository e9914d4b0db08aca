"""The nightly as production runs it: a real `prefect server start` with its services (the scheduler
among them), the project's deployments from deployments/prefect.yaml, and a real `prefect worker`.

The session's test harness cannot show this: it is the scheduler that creates the nightly's runs,
and a broken Prefect/SQLAlchemy pair fails there, every minute, while every other test passes.
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Scheduled

from flows.demo import BF16_REPO, demo_config
from tasks.history.last_good import LastGood, write_last_good
from tasks.hub import resolve_snapshot
from testkit.prefect_processes import BIN, prefect_server, prefect_worker, wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def real_server(tmp_path):
    with prefect_server(tmp_path) as (url, log):
        yield url, log


def test_scheduler_creates_nightly_runs_and_a_worker_completes_one(real_server, local_hub, tmp_path):
    url, server_log = real_server
    env = {**os.environ, "PREFECT_API_URL": url, "ROLLOUT_HOME": str(ROOT)}
    for command in (["work-pool", "create", "gpu-box-1", "--type", "process"],
                    ["--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"]):
        done = subprocess.run([str(BIN / "prefect"), *command], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        def scheduled():
            return client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["gpu-box-1"])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC)

        runs = wait_for(scheduled, 120, "the scheduler to create nightly runs", server_log)
        assert "bulk DML" not in server_log.read_text()
        berlin = [r.expected_start_time.astimezone(ZoneInfo("Europe/Berlin")) for r in runs]
        assert all((t.hour, t.minute) == (2, 0) for t in berlin), berlin
        assert all(r.auto_scheduled for r in runs)

        # Tonight's run, as the scheduler made it, becomes due now and points at this test's host:
        # the local hub, and a models root whose last good deployment is the hub's current commit.
        run = runs[0]
        config = demo_config(local_hub.endpoint, tmp_path / "models")
        commit = resolve_snapshot(BF16_REPO, "main", local_hub.endpoint).commit
        write_last_good(config.run_dir, LastGood(repo_id=BF16_REPO, commit=commit, model_dir=tmp_path / "x"))
        client.update_flow_run(run.id, parameters={"config": config.model_dump(mode="json")})
        client.set_flow_run_state(run.id, Scheduled(scheduled_time=datetime.now(timezone.utc)), force=True)
        asked = len(local_hub.requests)

        worker_log = tmp_path / "worker.log"
        with prefect_worker("gpu-box-1", env, tmp_path, worker_log):
            final = wait_for(lambda: (s := client.read_flow_run(run.id).state).is_final() and s, 180,
                             "the worker to run the nightly", worker_log)
        assert final.is_completed(), (final, worker_log.read_text()[-3000:])
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        assert [a.key for a in artifacts] == ["nightly-demo-tiny-moe"]
        assert f"**No change:** `main` is still commit `{commit}`" in artifacts[0].data
        # The run the scheduler made is findable: named for what it checked, tagged as the nightly.
        ran = client.read_flow_run(run.id)
        # The deployment names the host (ROLLOUT_HOST in its job variables), not the machine's hostname.
        assert ran.name == f"nightly tiny-moe@{commit[:7]} on gpu-box-1"
        assert {f"model:{BF16_REPO}", "revision:main", "trigger:nightly", "host:gpu-box-1"} <= set(ran.tags)
    # The "no change" path costs one hub call: nothing fetched, nothing started.
    assert all("/resolve/" not in r.path for r in local_hub.requests[asked:])
    assert not config.cache_dir.exists() and not (config.run_dir / "vllm.log").exists()
