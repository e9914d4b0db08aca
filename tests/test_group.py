"""A model larger than one box, without starting one: the group's form, each node's rank and command,
and the leader's rank check (the group on real vLLM CPU servers: tests/test_fleet.py, case 4)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from tasks.deployment.config import DeployConfig, Follower
from tasks.errors import ServerStartError
from tasks.vllm.command import build_command
from tasks.vllm.process import ServerHandle
from tasks.vllm.readiness import check_group
from tasks.vllm.settings import ServerConfig, VllmSettings


def _config(**vllm) -> DeployConfig:
    return DeployConfig(repo_id="moonshotai/Kimi-K2.5", vllm=VllmSettings(**vllm),
                        followers=[{"host": "gpu-box-2", "models_root": "/data"}, {"host": "gpu-box-3"}])


def test_each_secondary_node_gets_its_rank_and_its_own_models_root():
    tp = _config(tensor_parallel_size=24, nnodes=3, master_addr="10.0.0.1")
    assert [(host, c.vllm.node_rank, c.models_root, c.followers) for host, c in tp.group_members()] == [
        ("gpu-box-2", 1, Path("/data"), []), ("gpu-box-3", 2, Path("/models"), [])]
    dp = _config(tensor_parallel_size=8, data_parallel_size=6, data_parallel_size_local=2,
                 data_parallel_address="10.0.0.1")
    assert [c.vllm.data_parallel_start_rank for _, c in dp.group_members()] == [2, 4]


@pytest.mark.parametrize("vllm, message", [
    (dict(nnodes=2, master_addr="10.0.0.1"), "followers: 3 nodes, but vllm.nnodes is 2"),
    (dict(nnodes=3), "followers: vllm.master_addr"),
    (dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_address="h"),
     "3 nodes of 2 data-parallel ranks each, but vllm.data_parallel_size is 4"),
    (dict(), "followers: set vllm.nnodes"),
])
def test_a_group_whose_nodes_do_not_add_up_is_refused_with_the_form(vllm, message):
    with pytest.raises(ValueError, match=message):
        _config(**vllm)


def test_a_secondary_node_runs_vllms_headless_launch_with_no_api():
    cfg = ServerConfig(tensor_parallel_size=16, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                       model_path=Path("/m"), served_model_name="k", headless=True)
    command = build_command(cfg, None)
    assert command[1:6] == ["-m", "tasks.vllm.headless", "--model", "/m", "--headless"]
    assert "--port" not in command and command[command.index("--node-rank") + 1] == "1"
    # The launcher parses with the installed vLLM's own parser: a flag it lacks fails in seconds.
    done = subprocess.run([*command[:5], "--headless", "--no-such-flag"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unrecognized arguments: --no-such-flag" in done.stderr


def test_the_leader_must_report_every_rank(tmp_path):
    cfg = ServerConfig(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", model_path=tmp_path,
                       served_model_name="k")
    log = tmp_path / "vllm.log"
    handle = ServerHandle(pid=1, pgid=1, base_url="http://127.0.0.1:9", log_path=log, state_file=tmp_path / "s",
                          command=[])
    log.write_text("(Worker pid=7) INFO [parallel_state.py:2350] rank 0 in world size 2 is assigned as DP rank 0\n")
    check_group(handle, cfg)
    log.write_text("(Worker pid=7) INFO [parallel_state.py:2350] rank 0 in world size 1 is assigned as DP rank 0\n")
    with pytest.raises(ServerStartError, match="leader reports a world of 1 ranks, not the 2 of TP x PP over 2 "
                                               "nodes") as err:
        check_group(handle, cfg)
    assert err.value.cause == "group-incomplete"


def test_a_secondary_node_is_left_alone_by_its_hosts_nightly_and_deploys(prefect_server, local_hub, tmp_path):
    """Its GPUs run a group led from another host: a nightly there skips, a deploy there is refused,
    and neither stops the group's ranks."""
    import json
    import os
    import signal
    import sys

    from conftest import artifact

    from flows.demo import demo_config
    from flows.deploy import deploy_model
    from flows.nightly import nightly_refresh
    from tasks.errors import HostBusyError

    config = demo_config(local_hub.endpoint, tmp_path / "models")
    ranks = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", "tasks.vllm.headless"],
                             start_new_session=True)  # stands in for the headless ranks: their command line
    try:
        config.run_dir.mkdir(parents=True)
        (config.run_dir / "server.json").write_text(json.dumps(
            {"pid": ranks.pid, "pgid": ranks.pid, "base_url": "", "command": ranks.args}))
        assert nightly_refresh(config) == "in-group"
        assert artifact("nightly-demo-tiny-moe").data.startswith(
            "# Skipped: this host serves as a secondary node of a multi-node group")
        with pytest.raises(HostBusyError, match="secondary node of a multi-node group led from another host"):
            deploy_model(config)
        assert ranks.poll() is None  # the group's ranks still run
    finally:
        os.killpg(ranks.pid, signal.SIGKILL)
        ranks.wait()


def test_a_group_deploy_keeps_its_layout_over_settings_a_tune_run_promoted(prefect_server, local_hub, tmp_path, caplog):
    """A tune run measured one host: its winner (TP=1 + EP here) would have made the secondary node a
    data-parallel rank instead of node 1 of a TP=2 group."""
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowFilter, FlowFilterName
    from prefect.exceptions import ObjectAlreadyExists

    from flows.demo import BF16_REPO, demo_config
    from flows.deploy import deploy_model
    from flows.group import join_group
    from tasks.history.tuned import TunedSettings, write_tuned

    with get_client(sync_client=True) as client:
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name="host-z", type="process"))
    join_group.to_deployment(name="host-z").apply(work_pool_name="host-z")  # no worker polls host-z
    config = demo_config(local_hub.endpoint, tmp_path / "models", tensor_parallel_size=2, enable_expert_parallel=False,
                         nnodes=2, master_addr="127.0.0.1", startup_timeout_s=3,
                         followers=[Follower(host="host-z", models_root=tmp_path / "z")])
    write_tuned(config.run_dir, TunedSettings(repo_id=BF16_REPO, settings=config.vllm.model_copy(update=dict(
        tensor_parallel_size=1, enable_expert_parallel=True, nnodes=1, master_addr=None, max_num_seqs=2)),
        candidate="TP=1 + EP, max_num_seqs=2", time=datetime.now(timezone.utc)))
    with pytest.raises(ServerStartError, match="secondary node host-z: join-group/host-z: no worker took it within 3"):
        deploy_model(config)
    assert "not serving with the settings a tune run promoted" in caplog.text
    with get_client(sync_client=True) as client:
        joins = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["join-group"])),
                                      deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["host-z"])))
    asked = joins[0].parameters["config"]["vllm"]
    assert (asked["nnodes"], asked["node_rank"], asked["tensor_parallel_size"]) == (2, 1, 2)
