"""Start vLLM and wait until it serves: /health, the model listed, and one real token generated."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tasks.errors import ServerStartError
from tasks.vllm.log import PROGRESS, classify_failure, log_tail, server_facts
from tasks.vllm.process import ServerHandle, reap_stale, start_server, stop_server
from tasks.vllm.settings import ServerConfig


def _failed(handle: ServerHandle, what: str, cause: str | None = None) -> ServerStartError:
    full = handle.log_path.read_text(errors="replace") if handle.log_path.exists() else ""
    found, line = classify_failure(full)
    cause = cause or found
    return ServerStartError(f"vLLM {what} ({cause}): {line[:300]}", cause, log_tail(handle.log_path))


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
