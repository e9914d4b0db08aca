"""The fleet without running it: the hosts file and what it renders to, the waves, the outlier rule,
the verdict and the table (the rollout itself: tests/test_fleet.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from tasks.deployment.config import DeployConfig
from tasks.errors import UnusableInput
from tasks.fleet.hosts import FleetConfig, FleetHost, HostsFile, render
from tasks.fleet.rollout import HostOutcome, fleet_rows, outliers, verdict
from tasks.history.runs import RunRecord

ROOT = Path(__file__).resolve().parents[1]


def _fleet(n: int, wave_size: int = 2) -> FleetConfig:
    return FleetConfig(deploy=DeployConfig(repo_id="org/model"), wave_size=wave_size,
                       hosts=[FleetHost(name=f"box-{i}", gpu_type="8x SM120") for i in range(1, n + 1)])


def _record(peak: float, single: float = 80.0, parallelism: str = "TP8 EP") -> RunRecord:
    return RunRecord(model="org/model", revision="main", commit="c" * 40, time=datetime.now(timezone.utc), host="x",
                     gpu="8x SM120", vllm_version="0.11", parallelism=parallelism, single_stream_tok_s=single,
                     peak_tok_s=peak, knee_concurrency=64, p99_ttft_ms=None)


def test_the_canary_goes_alone_then_waves_of_the_set_size():
    assert [[h.name for h in w] for w in _fleet(6, 2).waves()] == [
        ["box-1"], ["box-2", "box-3"], ["box-4", "box-5"], ["box-6"]]
    assert [[h.name for h in w] for w in _fleet(1).waves()] == [["box-1"]]


def test_a_host_runs_the_model_pinned_with_its_own_root_port_mirror_and_extra_settings():
    fleet = _fleet(2)
    host = fleet.hosts[1].model_copy(update={"models_root": Path("/m2"), "port": 8001,
                                             "vllm": {"max_num_seqs": 64}})
    config = fleet.host_config(host, "a" * 40, "http://box-1:8090")
    assert (config.revision, config.models_root, config.port, config.mirror_endpoint) == (
        "a" * 40, Path("/m2"), 8001, "http://box-1:8090")
    assert config.vllm.max_num_seqs == 64 and config.vllm.enable_expert_parallel  # the model's own kept
    with pytest.raises(ValueError, match="not vLLM settings: max_num_seq"):
        FleetHost(name="box-9", vllm={"max_num_seq": 64})


def test_outliers_are_hosts_20_percent_below_their_gpu_types_median():
    fleet = _fleet(4)
    outcomes = [HostOutcome(h, 2, True, "Serving", record=_record(p)) for h, p in
                zip(fleet.hosts, (2300.0, 2250.0, 2350.0, 1700.0))]
    flagged = outliers(outcomes, 0.2)
    assert list(flagged) == ["box-4"] and "25% below the median of the 4 8x SM120 hosts (2,275.0)" in flagged["box-4"]
    # Other flags are another configuration: not compared.
    outcomes[3].record = _record(1700.0, parallelism="TP4 DP2 EP")
    assert outliers(outcomes, 0.2) == {}


def test_the_verdict_and_table_say_where_a_rollout_stopped_and_which_hosts_it_never_touched():
    fleet = _fleet(5)
    outcomes = [HostOutcome(fleet.hosts[0], 1, True, "Serving: ...", "run-1", _record(2300.0), {"hub": 6}),
                HostOutcome(fleet.hosts[1], 2, True, "Serving: ...", "run-2", _record(2280.0), {"mirror": 5, "hub": 1},
                            ["tokenizer.json: ChecksumError: ..."]),
                HostOutcome(fleet.hosts[2], 2, False, "Rolled back: org/model@cccc failed at the vLLM start: "
                            "ServerStartError: vLLM exited with code 1 during start-up (out-of-memory): ...", "run-3")]
    said = verdict("org/model", "c" * 40, fleet.hosts, outcomes=outcomes)
    assert said == ("Stopped: org/model@cccccccccccc failed on box-3 in wave 2: Rolled back: org/model@cccc failed "
                    "at the vLLM start; untouched, serving what they served: box-4, box-5")
    rows = fleet_rows(outcomes, fleet.hosts, slowdown=0.2)
    assert [(r["host"], r["wave"], r["status"]) for r in rows] == [
        ("box-1", 1, "serving"), ("box-2", 2, "serving"), ("box-3", 2, "rolled back"), ("box-4", None, "untouched"),
        ("box-5", None, "untouched")]
    assert rows[1]["fetched from"] == "mirror 5, hub 1" and rows[1]["mirror failures"] == 1
    assert rows[2]["verdict"].endswith("(out-of-memory): ...")  # the whole of it below the table
    assert verdict("org/model", "c" * 40, fleet.hosts[:2], outcomes=outcomes[:2]) == \
        "Rolled out: org/model@cccccccccccc serves on all 2 hosts"


def test_adding_a_host_is_one_entry_and_the_committed_deployments_are_the_rendered_ones(tmp_path):
    hosts = HostsFile.read(ROOT / "deployments" / "hosts.yaml")
    assert render(hosts) == (ROOT / "deployments" / "prefect.yaml").read_text()  # nobody edits prefect.yaml by hand
    data = yaml.safe_load((ROOT / "deployments" / "hosts.yaml").read_text())
    data["hosts"].append({"name": "gpu-box-2", "models_root": "/data/models", "port": 8001, "gpu_type": "8x H200"})
    (tmp_path / "hosts.yaml").write_text(yaml.safe_dump(data))
    rendered = yaml.safe_load(render(HostsFile.read(tmp_path / "hosts.yaml")))
    box2 = [d for d in rendered["deployments"] if d["name"] == "gpu-box-2"]
    assert sorted(d["entrypoint"] for d in box2) == [
        "flows/deploy.py:deploy_model", "flows/group.py:join_group", "flows/nightly.py:nightly_refresh",
        "flows/operate.py:rollback_model", "flows/operate.py:stop_model", "flows/tune.py:tune_model"]
    for d in box2:
        assert d["work_pool"] == {"name": "gpu-box-2", "work_queue_name": "default",
                                  "job_variables": {"env": {"ROLLOUT_HOST": "gpu-box-2"}}}
        if "target" in d["parameters"]:  # the operator's stop and rollback: the host's models root
            assert d["parameters"]["target"] == {"models_root": "/data/models"}
            continue
        config = d["parameters"]["config"].get("deploy", d["parameters"]["config"])
        assert (config["models_root"], config["port"]) == ("/data/models", 8001)
    fleet = next(d for d in rendered["deployments"] if d["name"] == "fleet")
    assert [h["name"] for h in fleet["parameters"]["config"]["hosts"]] == ["gpu-box-1", "gpu-box-2"]


@pytest.mark.parametrize("change, message", [
    (lambda d: d["hosts"].append(dict(d["hosts"][0])), "hosts: gpu-box-1 listed twice"),
    (lambda d: d["hosts"][0].update(port="eight"), "hosts.0.port: Input should be a valid integer"),
    (lambda d: d["hosts"][0].update(name="GPU Box"), "hosts.0.name: String should match pattern"),
])
def test_a_bad_hosts_file_is_one_line_naming_the_field(tmp_path, change, message):
    data = yaml.safe_load((ROOT / "deployments" / "hosts.yaml").read_text())
    change(data)
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UnusableInput, match=f"^{path}: {message}"):
        HostsFile.read(path)
    done = subprocess.run([sys.executable, "-m", "flows.cli", "deployments", "--hosts", str(path), "--out",
                           str(tmp_path / "out.yaml")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"error: {path}: " + done.stderr.split(
        f"{path}: ", 1)[1].strip()] and "Traceback" not in done.stderr
    assert not (tmp_path / "out.yaml").exists()


def test_rollout_fleet_needs_a_prefect_server_the_workers_poll(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "ph")}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "fleet"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: rollout fleet runs each host's deploy through its worker: set PREFECT_API_URL to the Prefect server "
        "the workers poll")


def test_rollout_fleet_refuses_a_router_that_does_not_answer_before_anything_starts(tmp_path):
    data = yaml.safe_load((ROOT / "deployments" / "hosts.yaml").read_text())
    data["router"] = {"admin": str(tmp_path / "no-haproxy.sock"), "backend": "fleet"}
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "fleet", "--hosts", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: {path}: router: router {tmp_path / 'no-haproxy.sock'}: cannot connect ([Errno 2] No such file or "
        "directory)"], done.stderr
