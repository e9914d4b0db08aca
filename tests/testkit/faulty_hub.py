"""The demo's local hub, made to misbehave on request the way networks and hubs do.

`inject` queues faults for a file's next GETs (a status with Retry-After, a connection reset or a
clean close mid-body, flipped bytes), `require_token` answers 401 without the token, `throttle_bps`
slows the body, and `requests` logs what was asked, so a test can see that a retry resumed;
`file_bytes_sent` tells range reads from downloads.
"""

from __future__ import annotations

import socket
import struct
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

from flows.demo.hub_server import HubHandler, LocalHub, LocalRepo


@dataclass(frozen=True)
class Fault:
    """What one GET of a file gets instead of a clean answer."""

    kind: str  # "status", "reset" (RST mid-body), "close" (clean close mid-body), "corrupt"
    status: int = 500
    retry_after: int | None = None
    after_bytes: int = 0  # for reset, close and corrupt: where in the body it happens


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range_start: int
    status: int


class FaultyHub(LocalHub):
    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0):
        super().__init__(root, host, port)
        self.file_bytes_sent = 0
        self.bytes_sent_by_file: dict[str, int] = defaultdict(int)
        self.requests: list[Request] = []
        self.require_token: str | None = None
        self.throttle_bps: float | None = None
        self._faults: dict[str, deque[Fault]] = defaultdict(deque)

    @property
    def handler(self) -> type[HubHandler]:
        return FaultyHandler

    def inject(self, rel: str, *faults: Fault) -> None:
        """Queue faults for the next GETs of file `rel` (any repo), one per request."""
        with self._lock:
            self._faults[rel].extend(faults)

    def next_fault(self, rel: str) -> Fault | None:
        with self._lock:
            return self._faults[rel].popleft() if self._faults[rel] else None

    def log(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


class FaultyHandler(HubHandler):
    owner: FaultyHub
    _fault: Fault | None = None

    def _serve(self) -> None:
        token = self.owner.require_token
        if token and self.headers.get("Authorization") != f"Bearer {token}":
            self._error(401, "", "Invalid credentials in Authorization header")
            return
        super()._serve()

    def _answered(self, rel: str, start: int, status: int) -> None:
        self.owner.log(Request(self.command, rel, start, status))

    def _send_file(self, repo: LocalRepo, rel: str) -> None:
        hub = self.owner
        self._fault = hub.next_fault(rel) if self.command == "GET" and rel in repo.files else None
        if self._fault and self._fault.kind == "status":
            start = self._span(repo.files[rel]["size"])[0]
            self._answered(rel, start, self._fault.status)
            wait = self._fault.retry_after
            self._error(self._fault.status, "", f"injected HTTP {self._fault.status}",
                        {"Retry-After": str(wait)} if wait is not None else None)
            return
        super()._send_file(repo, rel)

    def _write_body(self, fh, rel: str, start: int, end: int) -> None:
        hub, fault = self.owner, self._fault
        cut = start + fault.after_bytes if fault and fault.kind in ("reset", "close") else None
        flip = start + fault.after_bytes if fault and fault.kind == "corrupt" else None
        step = 1 << 20 if hub.throttle_bps is None else max(int(hub.throttle_bps / 20), 1)
        pos = start
        while pos <= end:
            want = min(step, end + 1 - pos, cut - pos if cut is not None else step)
            chunk = fh.read(want) if want > 0 else b""
            if flip is not None and pos <= flip < pos + len(chunk):
                chunk = bytearray(chunk)
                chunk[flip - pos] ^= 0xFF
                chunk = bytes(chunk)
            if chunk:
                with hub._lock:  # counted before it goes: a client that has the bytes finds them counted
                    hub.file_bytes_sent += len(chunk)
                    hub.bytes_sent_by_file[rel] += len(chunk)
                self.wfile.write(chunk)
                pos += len(chunk)
            if cut is not None and pos >= cut:
                self._cut(fault.kind)
                return
            if not chunk:
                return
            if hub.throttle_bps:
                time.sleep(len(chunk) / hub.throttle_bps)

    def _cut(self, kind: str) -> None:
        """End the body early: "reset" sends a TCP RST, "close" a clean FIN (a truncated body)."""
        self.wfile.flush()
        if kind == "reset":
            time.sleep(0.2)  # let the bytes sent so far arrive: an RST discards what the peer has not read
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            self.connection.shutdown(socket.SHUT_WR)
        self.close_connection = True
