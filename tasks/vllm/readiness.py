"""Start vLLM and wait until it serves: /health, the model listed, and one real token generated."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from pydantic import BaseModel

from tasks.vllm.log import PROGRESS, read_from, server_facts, start_failure
from tasks.vllm.process import (
    Prestarted,
    ServerHandle,
    cancel_prestart,
    open_gate,
    reap_stale,
    start_server,
    stop_server,
)
from tasks.vllm.settings import ServerConfig


def _follow(path: Path, offset: int, report: Callable[[str], None]) -> int:
    """Pass new progress lines of the log to report(); returns the new read offset."""
    chunk = read_from(path, offset)
    complete = chunk[: chunk.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        if PROGRESS.search(line):
            report(line.strip())
    return offset + len(complete)


def wait_ready(handle: ServerHandle, model_name: str, timeout_s: float, *, poll_s: float = 2.0,
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
                raise start_failure(handle.log_path, f"exited with code {code} during start-up")
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
    raise start_failure(handle.log_path, f"not ready after {timeout_s:.0f} s", cause="startup-timeout")


# What a secondary node logs once its engine ranks are launched and reaching for the leader.
HEADLESS_LAUNCHED = re.compile(r"Launching vLLM \(v[^)]*\) headless multiproc executor|"
                               r"Launching \d+ data parallel engine\(s\) in headless mode")
# What each rank logs as it joins torch.distributed: the leader's rank 0 names the group's size.
WORLD_SIZE = re.compile(r"rank \d+ in world size (\d+)")


def wait_headless(handle: ServerHandle, timeout_s: float, poll_s: float = 1.0) -> float:
    """A secondary node is up once vLLM says it launched its ranks; it has no API to ask. Whether
    they joined the group is the leader's to say (check_group)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if handle.process is not None and (code := handle.process.poll()) is not None:
            raise start_failure(handle.log_path, f"exited with code {code} during start-up")
        if handle.log_path.exists() and HEADLESS_LAUNCHED.search(handle.log_path.read_text(errors="replace")):
            return time.monotonic() - started
        time.sleep(poll_s)
    raise start_failure(handle.log_path, f"did not launch its ranks within {timeout_s:.0f} s", cause="startup-timeout")


def check_group(handle: ServerHandle, cfg: ServerConfig) -> None:
    """The leader of a multi-node group reports every rank: a group over --nnodes hosts is one
    torch.distributed world of tensor x pipeline ranks, which the leader joins only once all have;
    data parallelism over hosts shows one engine per rank in the leader's /metrics."""
    if cfg.nnodes > 1:
        sizes = WORLD_SIZE.findall(handle.log_path.read_text(errors="replace"))
        if not sizes or int(sizes[0]) != cfg.world_size:
            raise start_failure(handle.log_path, f"leader reports a world of {sizes[0] if sizes else 'no'} ranks, "
                                f"not the {cfg.world_size} of TP x PP over {cfg.nnodes} nodes",
                                cause="group-incomplete")
    if cfg.data_parallel_size_local and cfg.data_parallel_size > cfg.data_parallel_size_local:
        auth = {"Authorization": f"Bearer {handle.api_key}"} if handle.api_key else {}
        metrics = httpx.get(f"{handle.base_url}/metrics", headers=auth, timeout=10).text
        engines = set(re.findall(r'engine="(\d+)"', metrics))
        if len(engines) != cfg.data_parallel_size:
            raise start_failure(handle.log_path,
                                f"leader reports {len(engines)} of {cfg.data_parallel_size} data-parallel ranks",
                                cause="group-incomplete")


def start_and_wait(cfg: ServerConfig, run_dir: Path, timeout_s: float, *, api_key: str | None = None,
                   report: Callable[[str], None] = lambda line: None,
                   prestarted: Prestarted | None = None, poll_s: float = 2.0) -> ServerHandle:
    """Start vLLM and block until it serves (a real token included), or for a secondary node until
    its ranks are launched; a leader must also report every rank. On any failure the group is
    stopped before the error goes on, its log tail in the ServerStartError. A server `prestarted`
    for this very launch (its imports done while the old one served) is started through its gate;
    its start-up time counts from there."""
    reap_stale(run_dir / "server.json")
    if prestarted is not None and (prestarted.cfg, prestarted.run_dir, prestarted.api_key) != (cfg, run_dir, api_key):
        cancel_prestart(prestarted)  # prestarted for another launch: start this one as it is
        prestarted = None
    handle = open_gate(prestarted) if prestarted is not None else start_server(cfg, run_dir, api_key)
    try:
        if cfg.headless:
            handle.startup_s = wait_headless(handle, timeout_s)
        else:
            handle.startup_s = wait_ready(handle, cfg.served_model_name, timeout_s, report=report, poll_s=poll_s)
            check_group(handle, cfg)
    except BaseException:
        stop_server(handle)
        raise
    return handle


# A start's phases in the order vLLM goes through them, as the server artifact names them.
PHASES = {"weights_load_s": "weights loaded", "model_load_s": "model loaded (weights and placement)",
          "torch_compile_s": "torch.compile", "engine_init_s": "KV cache profile and allocation, warm-up",
          "graph_capture_s": "CUDA graph capture", "startup_s": "ready to answer (the whole start)"}


class ServerFacts(BaseModel):
    """What a start reported about itself: the version, the start-up time, the KV cache and the
    phases vLLM logs (each None where this vLLM or platform logs no such line)."""

    vllm_version: str
    startup_s: float
    kv_cache_tokens: int | None = None
    kv_cache_requests: float | None = None  # vLLM's "maximum concurrency" at max_model_len
    kv_cache_memory_gib: float | None = None  # may be negative: the weights left no room
    weights_load_s: float | None = None
    model_load_s: float | None = None
    torch_compile_s: float | None = None
    engine_init_s: float | None = None
    graph_capture_s: float | None = None

    @classmethod
    def from_log(cls, log: str, *, vllm_version: str, startup_s: float) -> ServerFacts:
        numbers = {key: float(value.replace(",", "").rstrip("x")) for key, value in server_facts(log).items()}
        if "kv_cache_tokens" in numbers:
            numbers["kv_cache_tokens"] = int(numbers["kv_cache_tokens"])
        return cls(vllm_version=vllm_version, startup_s=startup_s, **numbers)

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase vLLM logged, in start order; the whole start last."""
        return {key: getattr(self, key) for key in PHASES if getattr(self, key) is not None}


def slow_start(now: dict[str, float], before: dict[str, float] | None, *, factor: float = 1.5,
               floor_s: float = 10.0) -> str | None:
    """A start much slower than the last good one's: more than `factor` times as long and by more
    than `floor_s`. One earlier start gives no interval, so this is a ratio with a floor that a
    loaded 2-core machine's jitter (a few seconds) stays under. The phase that grew most is named."""
    if not before or "startup_s" not in before or "startup_s" not in now:
        return None
    was, took = before["startup_s"], now["startup_s"]
    if took <= was * factor or took - was <= floor_s:
        return None
    grew = max((k for k in now if k in before and k != "startup_s"), key=lambda k: now[k] - before[k], default=None)
    return (f"ready after {took:.0f} s against {was:.0f} s for the last good start (x{took / was:.1f})"
            + (f"; {PHASES[grew]} took {now[grew]:.1f} s against {before[grew]:.1f} s" if grew else ""))


def running_facts(handle: ServerHandle) -> ServerFacts:
    """What a run is compared by later: vLLM's version (asked of the server), start-up time, and the
    KV cache and phases its log reports."""
    try:
        version = httpx.get(f"{handle.base_url}/version", timeout=10).json().get("version", "unknown")
    except (httpx.HTTPError, ValueError):
        version = "unknown"
    return ServerFacts.from_log(handle.log_path.read_text(errors="replace"), vllm_version=version,
                                startup_s=round(handle.startup_s, 1))
