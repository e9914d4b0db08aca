"""deployments/prefect.yaml registered on the real test server, and the nightly flow's decision."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterTags,
)
from prefect.exceptions import ObjectAlreadyExists
from prefect.settings import PREFECT_API_URL, temporary_settings

import flows.nightly
from flows.demo import BF16_REPO, demo_config
from flows.fleet import fleet_rollout
from flows.nightly import nightly_refresh
from tasks.errors import FleetRolloutFailed, HostUnreachable
from tasks.fleet.hosts import FleetConfig, FleetHost
from tasks.history.last_good import LastGood, write_last_good
from tasks.hub import resolve_snapshot
from tasks.orchestration.remote_steps import run_on_host
from testkit.stalling_api import StallingApi

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def registered(prefect_server):
    """deployments/prefect.yaml registered as `prefect deploy --all` does it; no worker polls the pool."""
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name="gpu-box-1", type="process"))
        except ObjectAlreadyExists:
            pass
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "ROLLOUT_HOME": str(ROOT)}
    done = subprocess.run([str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy", "--all",
                           "--prefect-file", "deployments/prefect.yaml"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prefect_yaml_registers_the_nightly_and_redeploy_deployments(registered):
    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("nightly-refresh/gpu-box-1")
        redeploy = client.read_deployment_by_name("deploy-model/gpu-box-1")
        compare = client.read_deployment_by_name("compare-runs/compare")
        tune = client.read_deployment_by_name("tune-model/gpu-box-1")
        fleet = client.read_deployment_by_name("fleet-rollout/fleet")
        rollback = client.read_deployment_by_name("rollback-model/gpu-box-1")
        stop = client.read_deployment_by_name("stop-model/gpu-box-1")
    # The operator's forms: the host's models root, run by its own worker.
    for operator in (rollback, stop):
        assert operator.parameters == {"target": {"models_root": "/models"}}
        assert operator.work_pool_name == "gpu-box-1"
        assert operator.job_variables == {"env": {"ROLLOUT_HOST": "gpu-box-1"}}
        assert "startup_timeout_s" in operator.parameter_openapi_schema["definitions"]["HostTarget"]["properties"]
    # The tune form: the model as the redeploy's, the candidate space with the 8-GPU Kimi-K2.5 default.
    assert tune.parameters["config"]["deploy"]["repo_id"] == "moonshotai/Kimi-K2.5"
    space = tune.parameter_openapi_schema["definitions"]["TuneSpace"]["properties"]
    assert {"layouts", "max_num_seqs", "all2all_backend", "enable_eplb", "kv_cache_dtype", "flags"} <= set(space)
    assert compare.parameters == {"config": {"models": [], "threshold": 0.1}}
    assert "fail_on_regression" in compare.parameter_openapi_schema["definitions"]["CompareConfig"]["properties"]
    assert [(s.schedule.cron, s.schedule.timezone) for s in nightly.schedules] == [("0 2 * * *", "Europe/Berlin")]
    assert redeploy.schedules == []
    # The fleet form: the model and its hosts, the first the canary with its mirror.
    assert [h["name"] for h in fleet.parameters["config"]["hosts"]] == ["gpu-box-1"]
    assert fleet.parameters["config"]["hosts"][0]["mirror"] == "http://gpu-box-1:8090"
    assert "wave_size" in fleet.parameter_openapi_schema["definitions"]["FleetConfig"]["properties"]
    for deployment, strategy in ((nightly, "ENQUEUE"), (redeploy, "CANCEL_NEW")):
        assert deployment.work_pool_name == "gpu-box-1"
        assert deployment.job_variables == {"env": {"ROLLOUT_HOST": "gpu-box-1"}}
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == strategy
        config = deployment.parameters["config"]
        assert config["repo_id"] == "moonshotai/Kimi-K2.5" and config["vllm"]["tensor_parallel_size"] == 8
        assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
        # The UI form: DeployConfig's fields with their descriptions, the bench API as a dropdown.
        schema = deployment.parameter_openapi_schema
        assert "Hugging Face model repo" in schema["definitions"]["DeployConfig"]["properties"]["repo_id"]["description"]
        assert schema["definitions"]["BenchSpec"]["properties"]["api"]["enum"] == ["completions", "chat"]


def test_a_host_whose_worker_is_down_stops_the_fleet_at_its_pickup_deadline(registered, local_hub, tmp_path):
    host = FleetHost(name="gpu-box-1", models_root=tmp_path / "models", gpu_type="cpu")
    config = FleetConfig(deploy=demo_config(local_hub.endpoint, tmp_path / "models"), hosts=[host], pickup_deadline_s=3)
    started = time.monotonic()
    with pytest.raises(FleetRolloutFailed) as info:
        fleet_rollout(config)
    assert time.monotonic() - started < 60
    pinned = f"{BF16_REPO}@{resolve_snapshot(BF16_REPO, 'main', local_hub.endpoint).commit[:12]}"
    assert str(info.value) == (f"Stopped: {pinned} failed on gpu-box-1 in wave 1 (the canary): Failed: {pinned} "
                               "failed at the hand-over to the host's worker")
    fleet = artifact("fleet-demo-tiny-moe").data
    assert "HostUnreachable: deploy-model/gpu-box-1: no worker took it within 3 s; is a worker polling work pool " \
           "gpu-box-1 (`prefect worker start --pool gpu-box-1`)?" in fleet  # under "Why it stopped"
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["gpu-box-1"])),
                                     flow_filter=FlowFilter(name=FlowFilterName(any_=["deploy-model"])))
    assert [r.state.type.value for r in runs] == ["CANCELLED"]  # no worker will start it later, unasked
    assert "| gpu-box-1 |" in fleet


def test_nightly_on_an_unchanged_revision_downloads_and_starts_nothing(local_hub, tmp_path):
    config = demo_config(local_hub.endpoint, tmp_path / "models")
    commit = resolve_snapshot(BF16_REPO, "main", local_hub.endpoint).commit
    write_last_good(config.run_dir, LastGood(repo_id=BF16_REPO, commit=commit, model_dir=tmp_path / "x"))
    asked = len(local_hub.requests)
    assert nightly_refresh(config) == "no-change"
    assert "**No change:** `main` is still commit `" + commit in artifact("nightly-demo-tiny-moe").data
    assert not config.cache_dir.exists() and not (config.run_dir / "vllm.log").exists()
    assert all("/resolve/" not in r.path for r in local_hub.requests[asked:])  # no file was fetched


def test_nightly_deploys_a_moved_revision_pinned_to_the_new_commit(local_hub, tmp_path, monkeypatch):
    config = demo_config(local_hub.endpoint, tmp_path / "models")
    commit = resolve_snapshot(BF16_REPO, "main", local_hub.endpoint).commit
    write_last_good(config.run_dir, LastGood(repo_id=BF16_REPO, commit="0" * 40, model_dir=tmp_path / "x"))
    deployed = []
    monkeypatch.setattr(flows.nightly, "deploy_model", deployed.append)  # the deploy itself: test_e2e
    assert nightly_refresh(config) == "deployed"
    assert [(c.repo_id, c.revision) for c in deployed] == [(BF16_REPO, commit)]
    assert f"**Deployed:** commit `{commit}` (last good before: `{BF16_REPO}@{'0' * 40}`)" in (
        artifact("nightly-demo-tiny-moe").data)


def test_a_prefect_api_that_stalls_while_a_host_run_is_created_makes_one_run_not_two(registered):
    # The server creates the run, its answer is lost (a stall under load), and the client sends the
    # request again: the call's idempotency key makes the server hand back the same run. Without it
    # the host got a second run, which its deployment's concurrency limit cancelled, and which the
    # rollout followed to "Cancelled".
    tag = f"stall-{uuid.uuid4().hex[:8]}"
    with StallingApi(PREFECT_API_URL.value(), path_part="/create_flow_run") as api, \
            temporary_settings({PREFECT_API_URL: api.url}), pytest.raises(HostUnreachable, match="no worker took it"):
        run_on_host("stop-model/gpu-box-1", {"target": {"models_root": "/models"}}, 3, tags=[tag])
    assert len(api.stalled) == 1 and sum("/create_flow_run" in s for s in api.seen) == 2  # it was sent again
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
    assert [r.state.type.value for r in runs] == ["CANCELLED"]  # one run, cancelled at its pickup deadline
