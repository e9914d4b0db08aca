"""Process-group handling and failure classification, without starting vLLM (test_e2e does that)."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.errors import ServerStartError
from tasks.vllm.command import NOT_FLAGS, build_command, check_arguments
from tasks.vllm.log import classify_failure, server_facts
from tasks.vllm.options import quick_check
from tasks.vllm.process import (
    ensure_port_free,
    group_members,
    reap_stale,
    served_model,
    serving_group,
    start_server,
    stop_group,
)
from tasks.vllm.settings import ServerConfig, VllmSettings

# A leader that ignores SIGTERM and a child that does too: only SIGKILL of the group ends them.
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "time.sleep(600)']); time.sleep(600)"
)


def _spawn_group(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)
    for _ in range(100):
        if len(group_members(proc.pid)) >= 2:
            break
        __import__("time").sleep(0.05)
    return proc


def test_command_carries_parallelism_flags():
    cfg = ServerConfig(model_path=Path("/m"), served_model_name="kimi", tensor_parallel_size=8,
                       enable_expert_parallel=True, max_model_len=65536, extra_args=["--all2all-backend", "pplx"])
    cmd = build_command(cfg, 8001)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    assert "--tensor-parallel-size 8" in joined and "--enable-expert-parallel" in cmd
    assert "--max-model-len 65536" in joined and "--port 8001" in joined
    assert cmd[-2:] == ["--all2all-backend", "pplx"]


def test_defaults_leave_vllm_its_own_defaults():
    cmd = build_command(ServerConfig(model_path=Path("/m"), served_model_name="m"), 8000)
    for flag in ("--enable-expert-parallel", "--kv-cache-dtype", "--max-num-seqs", "--data-parallel-size",
                 "--trust-remote-code", "--all2all-backend"):
        assert flag not in cmd


def test_every_typed_field_reaches_the_command_line():
    cfg = ServerConfig(model_path=Path("/m"), served_model_name="m", data_parallel_size=2, pipeline_parallel_size=2,
                       all2all_backend="deepep_low_latency", max_num_seqs=256, max_num_batched_tokens=16384,
                       kv_cache_dtype="fp8", gpu_memory_utilization=0.92, trust_remote_code=True,
                       distributed_executor_backend="mp", nnodes=2, node_rank=1, master_addr="10.0.0.1",
                       data_parallel_size_local=1, data_parallel_start_rank=1, data_parallel_address="10.0.0.1",
                       data_parallel_rpc_port=13345)
    joined = " ".join(build_command(cfg, 8000))
    for part in ("--data-parallel-size 2", "--pipeline-parallel-size 2", "--all2all-backend deepep_low_latency",
                 "--max-num-seqs 256", "--max-num-batched-tokens 16384", "--kv-cache-dtype fp8",
                 "--gpu-memory-utilization 0.92", "--trust-remote-code", "--distributed-executor-backend mp",
                 "--nnodes 2 --node-rank 1", "--master-addr 10.0.0.1", "--data-parallel-size-local 1",
                 "--data-parallel-start-rank 1", "--data-parallel-address 10.0.0.1", "--data-parallel-rpc-port 13345"):
        assert part in joined


@pytest.mark.parametrize(
    "line, cause",
    [
        ("api_server.py: error: unrecognized arguments: --disable-log-requests", "invalid-argument"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "out-of-memory"),
        # vllm-project/vllm#34076, as an RTX 5070 Ti + 5090 D pipeline-parallel start logged it
        (("ValueError: To serve at least one request with the models's max seq len (262144), (24.0 GiB KV cache is "
          "needed, which is larger than the available KV cache memory (3.18 GiB). Based on the available memory, the "
          "estimated maximum model length is 34736. Try increasing `gpu_memory_utilization` or decreasing "
          "`max_model_len` when initializing the engine."), "kv-cache-too-small"),
        ("RuntimeError: NCCL error: unhandled system error", "nccl"),
        ("ValueError: No WNA16 MoE backend supports the deployment configuration", "unsupported-model"),
        ("OSError: [Errno 98] Address already in use", "port-in-use"),
        ("RuntimeError: something else broke", "exited"),
    ],
)
def test_failure_causes_are_classified_from_the_log(line, cause):
    found, shown = classify_failure(f"INFO starting\n{line}\nINFO shutting down")
    assert found == cause
    assert shown == line


def test_stop_group_escalates_to_sigkill_and_leaves_nothing():
    proc = _spawn_group(STUBBORN)
    assert len(group_members(proc.pid)) == 2
    stop_group(proc.pid, grace_s=0.5)
    proc.wait(timeout=5)
    assert group_members(proc.pid) == []


def test_reaper_stops_a_vllm_group_left_by_a_crashed_run(tmp_path):
    proc = _spawn_group(STUBBORN, "vllm.entrypoints.openai.api_server")  # looks like vLLM in /proc
    state = tmp_path / "server.json"
    state.write_text(json.dumps({"pid": proc.pid, "pgid": proc.pid}))
    assert reap_stale(state, grace_s=0.5) == proc.pid
    proc.wait(timeout=5)
    assert group_members(proc.pid) == [] and not state.exists()


def test_reaper_leaves_the_serving_deployment_alone(tmp_path):
    proc = _spawn_group(STUBBORN, "vllm.entrypoints.openai.api_server")
    state = tmp_path / "server.json"
    state.write_text(json.dumps({"pid": proc.pid, "pgid": proc.pid, "command": ["x", "--model", "/m"]}))
    try:
        assert reap_stale(state, keep_pgid=proc.pid) is None
        assert len(group_members(proc.pid)) == 2 and serving_group(state) == proc.pid
        assert served_model(state) == Path("/m")
    finally:
        assert reap_stale(state, grace_s=0.5) == proc.pid
        proc.wait(timeout=5)
    assert serving_group(state) is None and served_model(state) is None


def test_reaper_never_kills_a_group_that_is_not_vllm(tmp_path):
    proc = _spawn_group(STUBBORN)
    state = tmp_path / "server.json"
    state.write_text(json.dumps({"pid": proc.pid, "pgid": proc.pid}))
    try:
        reap_stale(state)
        assert len(group_members(proc.pid)) == 2
    finally:
        stop_group(proc.pid, grace_s=0.1)
        proc.wait(timeout=5)


def test_missing_model_path_fails_before_launch(tmp_path):
    with pytest.raises(ServerStartError, match="does not exist") as info:
        start_server(ServerConfig(model_path=tmp_path / "absent", served_model_name="m", port=0), tmp_path)
    assert info.value.cause == "model-path-missing"


def test_port_in_use_fails_before_launch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port 127.0.0.1:{port} is already in use") as info:
            start_server(ServerConfig(model_path=tmp_path, served_model_name="m", port=port), tmp_path)
    assert info.value.cause == "port-in-use"


def test_a_port_whose_last_server_just_closed_is_free_again():
    # The rollback restarts the last good server on its old address seconds after the new one
    # stopped: the stopped server closed its connections first, so they wait in TIME_WAIT on that
    # port. vLLM (uvicorn, SO_REUSEADDR) binds it; the check before launch must agree.
    listener = socket.create_server(("127.0.0.1", 0))  # SO_REUSEADDR, as uvicorn's
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server side closes first: its end goes to TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    ensure_port_free("127.0.0.1", port)


def test_cpus_the_host_does_not_have_fail_before_launch(tmp_path):
    with pytest.raises(ServerStartError, match="cpus 0,4095: this host lets vLLM use CPUs") as info:
        start_server(ServerConfig(model_path=tmp_path, served_model_name="m", port=0, cpus="0,4095"), tmp_path)
    assert info.value.cause == "cpus-unavailable"
    with pytest.raises(ValueError, match="cpus"):
        VllmSettings(cpus="0-")  # not a CPU list


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@needs_vllm
def test_installed_vllm_parser_refuses_a_removed_flag_by_name_then_remembers_its_flags(tmp_path):
    cfg = ServerConfig(model_path=Path("/m"), served_model_name="m", extra_args=["--disable-log-requests"])
    for attempt in ("parser in a child process", "cached option table"):
        with pytest.raises(ServerStartError, match="unrecognized arguments: --disable-log-requests") as info:
            check_arguments(build_command(cfg, 8000), tmp_path)
        assert info.value.cause == "invalid-argument", attempt
        assert list(tmp_path.glob("vllm-args-*.json")), attempt


@needs_vllm
def test_installed_vllm_parser_accepts_the_commands_we_build(tmp_path):
    cfg = ServerConfig(model_path=Path("/m"), served_model_name="m", tensor_parallel_size=8,
                       enable_expert_parallel=True, all2all_backend="allgather_reducescatter", max_model_len=4096,
                       max_num_seqs=128, max_num_batched_tokens=8192, kv_cache_dtype="fp8",
                       gpu_memory_utilization=0.92, data_parallel_size=2, trust_remote_code=True,
                       data_parallel_size_local=1, data_parallel_address="10.0.0.1", data_parallel_rpc_port=13345,
                       data_parallel_start_rank=1, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600,
                       distributed_executor_backend="mp", pipeline_parallel_size=2, enforce_eager=True,
                       kv_cache_memory_bytes=2**30, enable_auto_tool_choice=True, tool_call_parser="kimi_k2",
                       reasoning_parser="kimi_k2", load_format="safetensors", safetensors_load_strategy="prefetch",
                       extra_args=["--enable_prefix_caching", "--seed", "7", "--compilation-config.mode", "0"])
    command = build_command(cfg, 8000)
    # Every typed setting is on this command line, so the installed vLLM's parser vets each one.
    assert [name for name in VllmSettings.model_fields if name not in NOT_FLAGS
            and "--" + name.replace("_", "-") not in command] == []
    check_arguments(command, tmp_path)  # the child parses and writes the table
    check_arguments(build_command(cfg, 8000), tmp_path)  # the table agrees


TABLE = {"--model": None, "--tensor-parallel-size": None, "--kv-cache-dtype": ["auto", "fp8", "bfloat16"],
         "--enable-expert-parallel": None, "--no-enable-expert-parallel": None, "-O": None,
         "--compilation-config": None}


@pytest.mark.parametrize("args, problem", [
    (["--model", "m", "--tensor-parallel-size", "8"], None),
    (["--kv-cache-dtype=fp8", "--no-enable-expert-parallel", "-O", "3"], None),
    (["--tensor_parallel_size", "2", "--compilation-config.level", "3"], None),  # FlexibleArgumentParser spellings
    (["--model", "m", "--disable-log-requests"], "unrecognized arguments: --disable-log-requests"),
    (["--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4'"),
    (["--kv-cache-dtype=int2"], "invalid choice: 'int2'"),
])
def test_option_table_check(args, problem):
    found = quick_check(TABLE, args)
    assert (found is None) if problem is None else (problem in found)


GPU_LOG = """\
(Worker_TP0 pid=11) INFO [default_loader.py:501] Loading weights took 412.37 seconds
(Worker_TP0 pid=11) INFO [gpu_model_runner.py:2020] Model loading took 74.31 GiB memory and 418.02 seconds
(EngineCore pid=9) INFO [kv_cache_utils.py:1100] GPU KV cache size: 1,013,760 tokens
(EngineCore pid=9) INFO [kv_cache_utils.py:1104] Maximum concurrency for 65,536 tokens per request: 15.47x
(Worker_TP0 pid=11) INFO [gpu_model_runner.py:2500] Graph capturing finished in 41 secs, took 2.10 GiB
(EngineCore pid=9) INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 97.11 s
"""


def test_startup_facts_and_phases_are_read_from_the_log():
    assert server_facts(GPU_LOG) == {
        "kv_cache_tokens": "1,013,760", "kv_cache_requests": "15.47x", "weights_load_s": "412.37",
        "model_load_s": "418.02", "engine_init_s": "97.11", "graph_capture_s": "41",
    }
    assert server_facts("INFO nothing here") == {}


@pytest.mark.parametrize(("platform", "config", "extra_args", "fixed"), [
    ("cpu", {"kv_lora_rank": 512}, [], True),  # MLA on vLLM's CPU build: its rotary kernel misreads slices
    ("cpu", {"text_config": {"kv_lora_rank": 512}}, [], True),  # Kimi-K2.5 nests its text model's config
    ("cuda", {"kv_lora_rank": 512}, [], False),  # vLLM's CUDA kernel takes MLA's slices (PR #18046)
    ("cpu", {"num_key_value_heads": 2}, [], False),  # no MLA: contiguous query and key
    ("cpu", {"kv_lora_rank": 512}, ["-cc.mode=0"], False),  # the user's own compilation config is kept
])
def test_mla_on_a_cpu_host_takes_the_rotary_embedding_in_pytorch(tmp_path, platform, config, extra_args, fixed):
    from tasks.deployment.config import DeployConfig
    from tasks.deployment.stages import CPU_MLA_ROPE_ARGS, server_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    form = DeployConfig(repo_id="m/m", models_root=tmp_path, vllm=VllmSettings(extra_args=extra_args))
    server = server_config(form, tmp_path, platform)
    assert server.extra_args == extra_args + (CPU_MLA_ROPE_ARGS if fixed else [])
    assert ("--compilation-config" in build_command(server, 8000)) == fixed


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_compile_cache_is_kept_on_the_models_disk(tmp_path, platform):
    """On vLLM's CPU build the cache a warm start reads is Inductor's own (vLLM's AOT artifact cannot
    be loaded back there): both on the models disk, the AOT path off. A user's own setting is kept."""
    from tasks.deployment.config import DeployConfig
    from tasks.deployment.stages import server_config

    (tmp_path / "config.json").write_text("{}")
    form = DeployConfig(repo_id="m/m", models_root=tmp_path)
    env = server_config(form, tmp_path, platform).env
    cache = form.run_dir / "vllm-cache"
    assert env["VLLM_CACHE_ROOT"] == str(cache)
    if platform == "cpu":
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "torchinductor")
        assert env["VLLM_USE_AOT_COMPILE"] == "0"
    else:  # vLLM's piecewise backend keeps Inductor's and Triton's caches under VLLM_CACHE_ROOT itself
        assert "TORCHINDUCTOR_CACHE_DIR" not in env and "VLLM_USE_AOT_COMPILE" not in env
    own = DeployConfig(repo_id="m/m", models_root=tmp_path, vllm=VllmSettings(env={"VLLM_USE_AOT_COMPILE": "1"}))
    assert server_config(own, tmp_path, platform).env["VLLM_USE_AOT_COMPILE"] == "1"
