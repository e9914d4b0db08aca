"""The vLLM process group against the real vLLM CPU server, without the flow around it."""

from __future__ import annotations

import os
import shutil
import signal

import httpx
import pytest
from conftest import vllm_processes

from flows.demo import BF16_REPO
from tasks.errors import ServerStartError
from tasks.vllm.process import group_members, reap_stale, start_server, stop_server
from tasks.vllm.readiness import wait_ready
from tasks.vllm.settings import ServerConfig

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's own layout


def _config(model_dir, **kw) -> ServerConfig:
    return ServerConfig(model_path=model_dir, served_model_name="tiny", port=0, max_model_len=1024,
                        enable_expert_parallel=True, enforce_eager=True, env=CPU_ENV, **kw)


def test_kill_9_of_the_leader_then_the_reaper_leaves_no_process(hub_root, tmp_path):
    core = min(os.sched_getaffinity(0))  # the server on one core, as the demo keeps one for the client
    handle = start_server(_config(hub_root / BF16_REPO, cpus=str(core)), tmp_path, api_key="s3cret-key")
    try:
        wait_ready(handle, "tiny", timeout_s=600)  # ready includes an authenticated completion
        assert httpx.get(f"{handle.base_url}/v1/models", timeout=10).status_code == 401
        assert "s3cret-key" not in handle.state_file.read_text() and "s3cret-key" not in " ".join(handle.command)
        workers = [p for p in group_members(handle.pgid) if p != handle.pid]
        assert workers, "vLLM's engine and worker processes share the leader's group"
        assert {frozenset(os.sched_getaffinity(p)) for p in group_members(handle.pgid)} == {frozenset({core})}
        os.kill(handle.pid, signal.SIGKILL)  # what an OOM killer or a careless operator does
        handle.process.wait(timeout=10)
        state = handle.state_file
        assert state.exists()
        reap_stale(state, grace_s=5)
        assert group_members(handle.pgid) == [] and not state.exists()
    finally:
        stop_server(handle, grace_s=5)
    assert group_members(handle.pgid) == [] and vllm_processes() == []


def test_broken_config_json_dies_with_the_config_cause(hub_root, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(hub_root / BF16_REPO, model)
    (model / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"], ')
    handle = start_server(_config(model), tmp_path / "run")
    try:
        with pytest.raises(ServerStartError) as info:
            wait_ready(handle, "tiny", timeout_s=300)
        assert info.value.cause == "model-config", str(info.value)  # a config.json that is not JSON
        assert "exited with code" in str(info.value)
        assert info.value.log_tail
    finally:
        stop_server(handle, grace_s=5)
    assert group_members(handle.pgid) == [] and vllm_processes() == []
