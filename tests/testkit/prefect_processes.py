"""A real `prefect server start` and real `prefect worker`s, as production runs them: for the tests
where the scheduler or a worker is what is being tested (the nightly's schedule, the fleet)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
LEASES_ON_DISK = "prefect.server.concurrency.lease_storage.filesystem"  # as docker/compose.yaml and the CLI set it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout_s: float, what: str, log: Path | None = None):
    """condition()'s first truthy value; a timeout names what it waited for, with the log's tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(1)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log and log.exists() else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tail}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(process: subprocess.Popen, base_url: str, timeout_s: float = 30.0) -> None:
    """Until the server `process` runs answers /health at base_url; one that exits first, or a
    deadline passed, fails with its stderr."""
    deadline = time.monotonic() + timeout_s
    while not healthy(base_url):
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.1)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the group, SIGKILL if it is still there after a grace (a worker may wait on runs)."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@contextlib.contextmanager
def prefect_server(home: Path, ui: bool = False, port: int | None = None) -> Iterator[tuple[str, Path]]:
    """`prefect server start` on SQLite in its own PREFECT_HOME, every service on, the UI only when
    asked (at the server's address, without /api): (API URL, log). A server started again on the same
    home and port is the same server, restarted."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1", "PREFECT_UI_ENABLED": str(ui).lower(), "PREFECT_UI_URL": url.removesuffix("/api"),
           "PREFECT_UI_API_URL": url,  # what the UI in a browser calls; it defaults to port 4200
           "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": LEASES_ON_DISK}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_LOGGING_SETTINGS_PATH", None)  # an in-process CLI test's embedded-server routing: this log keeps all
    log = home / f"server-{time.time():.0f}.log"
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: server.poll() is not None or healthy(url), 180, "prefect server start", log)
        assert server.poll() is None, log.read_text()
        yield url, log
    finally:
        stop(server)


@contextlib.contextmanager
def prefect_worker(pool: str, env: dict[str, str], cwd: Path, log: Path, poll_s: int = 1
                   ) -> Iterator[subprocess.Popen]:
    """A process worker polling `pool` every `poll_s` seconds. Each poll writes to the server's
    database: three workers polling every second kept SQLite locked, and an artifact's write then
    waited a minute."""
    worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"],
                              cwd=cwd, env={**env, "PREFECT_WORKER_QUERY_SECONDS": str(poll_s)}, stdout=log.open("wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield worker
    finally:
        stop(worker)
