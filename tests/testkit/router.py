"""A real HAProxy in front of the test's hosts, and a steady client load through it: the fleet's
users, counted by the test itself."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tasks.fleet.router import RouterConfig, haproxy_config

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


@contextlib.contextmanager
def haproxy(servers: list[tuple[str, str, int]], *, work_dir: Path, port: int,
            edit: Callable[[str], str] = lambda cfg: cfg) -> Iterator[RouterConfig]:
    """HAProxy in the foreground (-db), configured by the product's own haproxy_config (as `edit`
    changes it: a router its operator configured otherwise); stopped at exit."""
    if not Path(HAPROXY).exists():
        raise AssertionError("haproxy is not installed: apt-get install haproxy (.ci/run does)")
    router = RouterConfig(admin=str(work_dir / "haproxy.sock"), backend="fleet", frontend="clients",
                          admit_timeout_s=30)
    config = work_dir / "haproxy.cfg"
    config.write_text(edit(haproxy_config(servers, router=router, bind=f"127.0.0.1:{port}")))
    log = (work_dir / "haproxy.log").open("w")
    process = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not Path(router.admin).exists():
            assert process.poll() is None and time.monotonic() < deadline, (work_dir / "haproxy.log").read_text()
            time.sleep(0.05)
        yield router
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


@dataclass(frozen=True)
class Request:
    started: float  # time.time()
    ended: float
    error: str | None  # None: a complete 200 answer

    @property
    def failed(self) -> bool:
        return self.error is not None


class SteadyLoad:
    """`streams` clients that each send one short streamed completion after another through the
    router, for as long as the block runs, and record every request's outcome."""

    def __init__(self, base_url: str, model: str, *, streams: int = 2, max_tokens: int = 8, pause_s: float = 0.05):
        self.base_url, self.model, self.streams = base_url, model, streams
        self.max_tokens, self.pause_s = max_tokens, pause_s
        self.requests: list[Request] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> SteadyLoad:
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.streams)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _client(self, i: int) -> None:
        body = {"model": self.model, "prompt": f"{11 + i} {12 + i} {13 + i}", "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as client:
            while not self._stop.is_set():
                started, error = time.time(), None
                try:
                    with client.stream("POST", f"{self.base_url}/v1/completions", json=body) as reply:
                        if reply.status_code != 200:
                            error = f"HTTP {reply.status_code}"
                        else:
                            text = "".join(reply.iter_text())
                            if "[DONE]" not in text:
                                error = "stream ended without [DONE]"
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                self.requests.append(Request(started, time.time(), error))
                self._stop.wait(self.pause_s)

    def between(self, since: float, until: float) -> list[Request]:
        """The requests started in a window (as the router counts them: when they arrive)."""
        return [r for r in self.requests if since <= r.started <= until]

    def failed_between(self, since: float, until: float) -> list[Request]:
        """The requests that failed in a window (as the router counts them: when they are cut)."""
        return [r for r in self.requests if r.failed and since <= r.ended <= until]
