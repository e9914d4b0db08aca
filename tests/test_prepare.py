"""prepare_model on the Prefect test server: the disk plan, the fetch artifacts and the HF token."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import artifact
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker

from flows.demo import BF16_REPO, demo_config
from flows.prepare import prepare_model
from tasks.disk import GB, inventory, measure
from tasks.errors import DiskSpaceError
from tasks.hub import PART_SUFFIX
from testkit.faulty_hub import FaultyHub

pytestmark = pytest.mark.usefixtures("prefect_server")
TOKEN = "hf_rollout_test_token_never_shown"


def _fetch_rows() -> list[dict]:
    return json.loads(artifact("fetch-demo-tiny-moe").data)


def _logs_of(client, run_id, wait_s: float = 20.0) -> list:
    """The API stores log batches asynchronously even after the worker drained: poll briefly."""
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
    deadline = time.monotonic() + wait_s
    while not (logs := client.read_logs(log_filter=log_filter)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return logs


def test_token_from_a_secret_block_reaches_the_hub_and_nowhere_else(hub_root, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    Secret(value=TOKEN).save("hf-token-test", overwrite=True)
    with FaultyHub(hub_root) as hub:
        hub.require_token = TOKEN
        config = demo_config(hub.endpoint, tmp_path / "models", hf_token_secret="hf-token-test")
        state = prepare_model(config, return_state=True)
        assert state.is_completed(), state.message
        first = _fetch_rows()
        assert first[-1]["file"] == "(all, wall clock)" and first[-1]["downloaded_MB"] > 5
        assert all(r["MB_per_s"] > 0 for r in first if r["downloaded_MB"] > 1)
        assert float(artifact("fetch-progress-demo-tiny-moe").data) == 100.0

        again = prepare_model(config, return_state=True)  # a re-run after success downloads nothing
        assert again.is_completed()
        assert all(r["downloaded_MB"] == 0 for r in _fetch_rows())

    assert "HF_TOKEN" not in os.environ  # the block's value does not outlive the flow
    APILogWorker.drain_all(timeout=10)  # logs reach the API in batches
    with get_client(sync_client=True) as client:
        for run_id in (state.state_details.flow_run_id, again.state_details.flow_run_id):
            run = client.read_flow_run(run_id)
            logs = _logs_of(client, run_id)
            artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
            assert logs and artifacts and tasks
            seen = json.dumps(run.parameters) + "".join(entry.message for entry in logs)
            seen += "".join(str(a.data) + str(a.description) for a in artifacts)
            seen += "".join(t.model_dump_json() for t in tasks)
            assert TOKEN not in seen


def _stale_model(models_root, size: int = 400 * 10**6):
    folder = models_root / "old-nvfp4-by-hand"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(size))
    os.utime(folder / "model.safetensors", (0, 0))  # used long ago
    return folder


def test_dry_run_plans_and_refuses_then_evict_deletes_and_measures(local_hub, hub_root, tmp_path):
    models = tmp_path / "models"
    stale = _stale_model(models)
    model_bytes = sum(f.stat().st_size for f in (hub_root / BF16_REPO).iterdir())
    # the new model (about 6 MB) plus the margin is 20 MB more than the disk has: the 400 MB folder must go
    # (it leaves room for what the tests beside this one write to the same disk meanwhile: with 40 MB,
    # the other worker's writes once made the gap larger than the folder)
    margin = (measure(models).free_bytes - model_bytes + 20 * 10**6) / GB
    config = demo_config(local_hub.endpoint, models, disk_margin_gb=margin)
    with pytest.raises(DiskSpaceError, match=r"dry run: .*old-nvfp4-by-hand.*set evict=true"):
        prepare_model(config)
    assert stale.exists() and not (models / "hub").exists()
    plan = json.loads(artifact("disk-plan-demo-tiny-moe-table").data)
    assert [r["action"] for r in plan if r["model"] == str(stale)] == ["evict"]

    margin = (measure(models).free_bytes - model_bytes + 20 * 10**6) / GB
    prepared = prepare_model(config.model_copy(update={"evict": True, "disk_margin_gb": margin}))
    assert not stale.exists()
    assert prepared.validation.verdict == "pass"
    after = artifact("disk-after-demo-tiny-moe").data
    assert "Free before" in after and "measured 0.40 GB, planned 0.40 GB" in after
    assert [m.name for m in inventory(models)] == [f"{BF16_REPO}@{prepared.commit[:12]}"]
    shutil.rmtree(models)


_PREPARE_IN_CHILD = """
import sys
from pathlib import Path
from flows.demo import demo_config
from flows.prepare import prepare_model
prepare_model(demo_config(sys.argv[1], Path(sys.argv[2])))
"""


def test_flow_killed_mid_download_resumes_on_the_next_run(hub_root, tmp_path):
    from prefect.settings import PREFECT_API_URL

    models = tmp_path / "models"
    source = hub_root / BF16_REPO / "model.safetensors"
    weights = source.stat().st_size
    part = models / "hub" / "models--demo--tiny-moe" / "blobs" / (hashlib.sha256(source.read_bytes()).hexdigest()
                                                                  + PART_SUFFIX)
    with FaultyHub(hub_root) as hub:
        hub.throttle_bps = 2 * 10**6  # the 6 MB weights take about 3 s
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
        child = subprocess.Popen([sys.executable, "-c", _PREPARE_IN_CHILD, hub.endpoint, str(models)], env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (part.exists() and part.stat().st_size > 10**6):
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)  # no hook, no finally: what a power cut or OOM kill does
        child.wait()
        held = part.stat().st_size
        assert 10**6 < held < weights
        hub.throttle_bps = None
        prepared = prepare_model(demo_config(hub.endpoint, models))
    rows = {r["file"]: r for r in _fetch_rows()}
    assert rows["model.safetensors"]["resumed_from_MB"] == round(held / 1e6, 3)
    assert rows["model.safetensors"]["downloaded_MB"] == round((weights - held) / 1e6, 3)
    assert all(r["downloaded_MB"] == 0 for name, r in rows.items() if name not in ("model.safetensors",
                                                                                 "(all, wall clock)"))
    assert prepared.validation.verdict == "pass"
    assert (prepared.model_dir / "model.safetensors").read_bytes() == source.read_bytes()
