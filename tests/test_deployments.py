"""deployments/prefect.yaml registered on the real test server, and the nightly flow's decision."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists
from prefect.settings import PREFECT_API_URL

import flows.nightly
from flows.demo import BF16_REPO, demo_config
from flows.nightly import nightly_refresh
from tasks.history.last_good import LastGood, write_last_good
from tasks.hub import resolve_snapshot

pytestmark = pytest.mark.usefixtures("prefect_server")
ROOT = Path(__file__).resolve().parents[1]


def test_prefect_yaml_registers_the_nightly_and_redeploy_deployments():
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
    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("nightly-refresh/gpu-box-1")
        redeploy = client.read_deployment_by_name("deploy-model/gpu-box-1")
        compare = client.read_deployment_by_name("compare-runs/compare")
        tune = client.read_deployment_by_name("tune-model/gpu-box-1")
        fleet = client.read_deployment_by_name("fleet-rollout/fleet")
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
