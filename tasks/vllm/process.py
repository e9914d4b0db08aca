"""vLLM as a child process in its own session, so its whole process group can be found and stopped.

The group holds the API server and the engine and worker processes it spawns (VLLM::EngineCore,
VLLM::Worker_*). Stopping signals the whole group; a state file under the run directory lets a
later run reap a server that a crashed run left behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tasks.cpus import parse_cpus
from tasks.errors import ServerStartError
from tasks.trust import read_state_text
from tasks.vllm.command import build_command, check_arguments
from tasks.vllm.log import read_from, start_failure
from tasks.vllm.settings import ServerConfig


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


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ensure_port_free(host: str, port: int) -> None:
    """Refuse a port something listens on. SO_REUSEADDR, as vLLM's uvicorn binds: without it, the
    TIME_WAIT connections a just-stopped server leaves would refuse its own rollback's restart."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ServerStartError(f"port {host}:{port} is already in use", "port-in-use", "") from exc


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state first, pgid third, start time 20th); None for a
    process that is gone or dead and not yet reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields


def process_start_time(pid: int) -> str | None:
    """When the process started, in clock ticks: with its pid, it names a process that the kernel
    cannot hand to another one (a reused pid starts later). None once it is gone."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group, read from /proc."""
    return [pid for pid in _pids() if (fields := _stat(pid)) and int(fields[2]) == pgid]


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def start_server(cfg: ServerConfig, run_dir: Path, api_key: str | None = None) -> ServerHandle:
    """Launch vLLM in a new session; the state file is written before anything can fail later."""
    port, command = _checked_launch(cfg, run_dir)
    if port is not None:
        ensure_port_free(cfg.host, port)
    log_path = run_dir / "vllm.log"
    proc = _launch(command, cfg, log_path, api_key)
    return _serving(cfg, run_dir, port=port, command=command, proc=proc, log_path=log_path, api_key=api_key)


@dataclass
class Prestarted:
    """A vLLM launched ahead of its start and held at its gate (tasks.vllm.gate): its Python imports
    run while the host's old server still answers; it binds no port and touches no accelerator, and
    writes no state file (the run directory's server.json still names the old server), until
    `open_gate`. It gives up by itself if the process that launched it dies."""

    cfg: ServerConfig
    run_dir: Path
    port: int | None
    command: list[str]  # vLLM's own command, as the server artifact and server.json show it
    process: subprocess.Popen
    gate: Path
    log_path: Path
    api_key: str | None = field(default=None, repr=False)


def _checked_launch(cfg: ServerConfig, run_dir: Path) -> tuple[int | None, list[str]]:
    """What every launch checks before anything runs: the model, the CPUs, the flags; its port."""
    if not cfg.model_path.is_dir():
        raise ServerStartError(f"model path {cfg.model_path} does not exist", "model-path-missing", "")
    if cfg.cpus and not parse_cpus(cfg.cpus) <= (usable := os.sched_getaffinity(0)):
        raise ServerStartError(f"cpus {cfg.cpus}: this host lets vLLM use CPUs {_cpu_list(usable)} only",
                               "cpus-unavailable", "")
    port = None if cfg.headless else cfg.port or _free_port(cfg.host)  # a headless node serves no API
    command = build_command(cfg, port)
    check_arguments(command, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return port, command


def _launch(command: list[str], cfg: ServerConfig, log_path: Path, api_key: str | None, *,
            cpus: set[int] | None = None) -> subprocess.Popen:
    """vLLM's process, in its own group, on `cpus` (default: the server's own, `cfg.cpus`)."""
    env = {**os.environ, **cfg.env}
    if api_key:
        env["VLLM_API_KEY"] = api_key  # vLLM reads it there; on the command line it would show in ps
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    if cpus := cpus or parse_cpus(cfg.cpus):
        # Popen has returned after exec, while vLLM is still importing: every process and thread it
        # starts later (engine core, workers) inherits this affinity.
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def _cpus_while_held(cfg: ServerConfig) -> set[int] | None:
    """Where a prestarted vLLM imports while the old server still answers: off the server's CPUs
    (the old one runs there), on the rest this process may use; on the server's where there is no
    rest. It moves to the server's CPUs when its gate opens."""
    server = parse_cpus(cfg.cpus)
    if server is None:
        return None
    return (os.sched_getaffinity(0) - server) or server


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of the process (an affinity is per thread; those it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _serving(cfg: ServerConfig, run_dir: Path, *, port: int | None, command: list[str], proc: subprocess.Popen,
             log_path: Path, api_key: str | None) -> ServerHandle:
    handle = ServerHandle(
        pid=proc.pid, pgid=proc.pid, base_url=f"http://{cfg.host}:{port}" if port else "", log_path=log_path,
        state_file=run_dir / "server.json", command=command, process=proc, api_key=api_key,
    )
    handle.state_file.write_text(json.dumps({"pid": handle.pid, "pgid": handle.pgid, "base_url": handle.base_url,
                                             "log_path": str(log_path), "command": command}))
    return handle


def prestart_server(cfg: ServerConfig, run_dir: Path, api_key: str | None = None) -> Prestarted:
    """Launch vLLM's API server held at a gate; `open_gate` starts it, `cancel_prestart` ends it."""
    if cfg.headless:
        raise ValueError("a secondary node's headless launch is not prestarted")
    port, command = _checked_launch(cfg, run_dir)
    gate, log_path = run_dir / "vllm.gate", run_dir / "vllm.next.log"
    gate.unlink(missing_ok=True)
    proc = _launch([command[0], "-m", "tasks.vllm.gate", str(gate), *command[1:]], cfg, log_path, api_key,
                   cpus=_cpus_while_held(cfg))
    return Prestarted(cfg=cfg, run_dir=run_dir, port=port, command=command, process=proc, gate=gate,
                      log_path=log_path, api_key=api_key)


def open_gate(pre: Prestarted) -> ServerHandle:
    """Start the prestarted vLLM, now that its port is free: its log becomes the run's vllm.log and
    its group the one server.json records (so a later run can stop it), then the gate opens."""
    if (code := pre.process.poll()) is not None:
        raise start_failure(pre.log_path, f"exited with code {code} while held at its gate")
    if pre.port is not None:
        try:
            ensure_port_free(pre.cfg.host, pre.port)
        except ServerStartError:
            cancel_prestart(pre)
            raise
    log_path = pre.run_dir / "vllm.log"
    os.replace(pre.log_path, log_path)  # the process writes on through its open file
    handle = _serving(pre.cfg, pre.run_dir, port=pre.port, command=pre.command, proc=pre.process,
                      log_path=log_path, api_key=pre.api_key)
    if pre.cfg.cpus:
        _pin(pre.process.pid, parse_cpus(pre.cfg.cpus))
    pre.gate.write_text("open")
    return handle


IMPORTED = b"tasks.vllm.gate: "  # the gate's own line, once its imports are done (or it gave up)


def wait_imported(pre: Prestarted, timeout_s: float, *, poll_s: float = 0.1) -> float:
    """Seconds until the prestarted vLLM's imports are done; one that exits first is a failed start
    (the old server still serves). Past `timeout_s` the swap goes on: the gate opens when it can."""
    started = time.monotonic()
    offset, seen = 0, b""
    while time.monotonic() - started < timeout_s:
        if (code := pre.process.poll()) is not None:
            raise start_failure(pre.log_path, f"exited with code {code} while it was imported ahead of the swap")
        chunk = read_from(pre.log_path, offset)
        offset += len(chunk)
        seen = seen[-len(IMPORTED):] + chunk  # the line may straddle two reads
        if IMPORTED in seen:
            break
        time.sleep(poll_s)
    return time.monotonic() - started


def cancel_prestart(pre: Prestarted) -> None:
    """End a prestarted vLLM that will not be started (the swap failed before its start); one whose
    gate opened is the run's server, and is left alone."""
    if pre.gate.exists() and pre.gate.read_text().strip() == "open":
        return
    pre.gate.write_text("cancel")
    stop_group(pre.process.pid, grace_s=5.0)
    pre.process.wait(timeout=10)
    pre.gate.unlink(missing_ok=True)
    pre.log_path.unlink(missing_ok=True)


def signalable(pgid: object) -> bool:
    """Whether a process group from a state file may be signalled at all: a whole number above 1
    (0 is the caller's own group, 1 init's, a negative one means every process there is), not the
    caller's own group, and not holding init or the caller."""
    if type(pgid) is not int or pgid <= 1 or pgid == os.getpgrp():
        return False
    members = group_members(pgid)
    return 1 not in members and os.getpid() not in members


def vllm_group(pgid: object) -> bool:
    """A signalable group that still runs vLLM: a recycled pgid must not take an unrelated process
    down. Orphaned children carry vLLM's process titles (VLLM::EngineCore, VLLM::Worker_TP0)."""
    if not signalable(pgid):
        return False
    return any(b"vllm" in _cmdline(pid).lower() for pid in group_members(pgid))


def stop_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM the group, SIGKILL what is left after the grace period, and check nothing remains."""
    if type(pgid) is not int or pgid <= 1 or pgid == os.getpgrp():
        raise ValueError(f"process group {pgid!r} is not one to stop: init's, this process's own, or every process")
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
        state = json.loads(read_state_text(state_file))
        pgid = state["pgid"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    # Only a group that still runs vLLM, and never init's, this process's own or "every process".
    return state if isinstance(state, dict) and vllm_group(pgid) else None


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


def serving_headless(state_file: Path) -> bool:
    """Whether the vLLM recorded there runs a secondary node's ranks: a group led from another host."""
    state = _live_state(state_file)
    return state is not None and "tasks.vllm.headless" in state.get("command", [])


def served_model(state_file: Path) -> Path | None:
    """The --model of the vLLM recorded in the state file, while its process group still runs."""
    state = _live_state(state_file)
    command = state.get("command", []) if state else []
    return Path(command[command.index("--model") + 1]) if "--model" in command else None


def vllm_groups() -> dict[int, str]:
    """Every process group on this host that runs vLLM, with its --port where a member's command
    names one: what a damaged state file leaves the host unable to account for."""
    groups: dict[int, str] = {}
    for pid in _pids():
        args = _cmdline(pid).split(b"\0")
        if pid == os.getpid() or not any(b"vllm" in a.lower() for a in args[:3]) or not (fields := _stat(pid)):
            continue
        port = args[args.index(b"--port") + 1].decode() if b"--port" in args[:-1] else ""
        groups[int(fields[2])] = groups.get(int(fields[2])) or port
    return groups


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
