"""A hub that lies, built on the tests' faulty hub: what an attacker who answers for HF_ENDPOINT (a
wrong endpoint, a compromised mirror, a man in the middle on plain HTTP) can send. It answers a
made-up repo's files at any URL that ends in their names, as such a hub would, whatever the commit
in the URL turned into.

Beside the real repos under its root it serves made-up ones (`fake`): their API answer says what
the test wants (a commit sha that is a path, names with NUL, hashes that are paths, an answer that
never ends), and their files are `Body`s: bytes by offset, so a 100 MB safetensors header costs no
disk, and a body may run on past its published size. Every request's Authorization header is
recorded (`auth_seen`), `redirect` answers a file with a 302 elsewhere, and `sent` counts the body
bytes each file actually went out with, so a test sees where a client stopped reading.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlsplit

from flows.demo.hub_server import _API, _RESOLVE
from tasks.mirror import BackgroundServer, byte_span
from testkit.faulty_hub import FaultyHandler, FaultyHub

PIECE = 1 << 20


@dataclass
class Body:
    """A file the hostile hub makes up: `size` is what it publishes, `read(offset, n)` its bytes."""

    size: int
    read: Callable[[int, int], bytes]
    sha256: str = "0" * 64
    runs_on: int = 0  # a whole-file GET goes on this many bytes past `size` (a body that "never" ends)
    announce: bool = False  # with runs_on: say so in Content-Length instead of closing to end the body

    @classmethod
    def of(cls, data: bytes, **kwargs) -> Body:
        """Real bytes, published with their own size and sha256."""
        return cls(len(data), lambda offset, n: data[offset:offset + n], hashlib.sha256(data).hexdigest(), **kwargs)


def claimed_header(length: int, data_len: int = 0) -> Body:
    """A safetensors file whose header claims `length` bytes, and has them: one JSON object with a
    single string of As, made up as it is read."""
    head = b'{"__metadata__":{"x":"'
    tail = b'"}}'
    parts = [(0, struct.pack("<Q", length)), (8, head)]
    total = 8 + length + data_len

    def read(offset: int, n: int) -> bytes:
        out = bytearray()
        end = min(offset + n, total)
        pos = offset
        while pos < end:
            if pos < 8 + len(head):
                start, blob = next((s, b) for s, b in parts if s <= pos < s + len(b))
                chunk = blob[pos - start: end - start]
            elif pos < 8 + length - len(tail):
                chunk = b"A" * (min(end, 8 + length - len(tail)) - pos)
            elif pos < 8 + length:
                chunk = tail[pos - (8 + length - len(tail)): end - (8 + length - len(tail))]
            else:
                chunk = bytes(end - pos)
            out += chunk
            pos += len(chunk)
        return bytes(out)

    return Body(total, read)


@dataclass
class FakeRepo:
    commit: str = "c0ffee" * 6 + "c0ff"
    files: dict[str, Body] = field(default_factory=dict)
    extra_siblings: list[dict] = field(default_factory=list)  # entries sent as they are
    unlisted: dict[str, Body] = field(default_factory=dict)  # served, but only extra_siblings list them
    api_runs_on: int = 0  # the API answer never ends (up to this many bytes)


def sibling(rel: str, body: Body) -> dict:
    entry = {"rfilename": rel, "size": body.size, "blobId": hashlib.sha1(rel.encode()).hexdigest()}
    if rel.endswith(".safetensors") or body.sha256 != "0" * 64:
        entry["lfs"] = {"size": body.size, "sha256": body.sha256, "pointerSize": 134}
    return entry


class HostileHub(FaultyHub):
    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0):
        super().__init__(root, host, port)
        self.fakes: dict[str, FakeRepo] = {}
        self.redirects: dict[str, str] = {}  # file -> where a GET of it is sent (302)
        self.auth_seen: list[tuple[str, str | None]] = []  # (path, Authorization) of every request
        self.sent: dict[str, int] = defaultdict(int)  # body bytes written per made-up file

    @property
    def handler(self) -> type[FaultyHandler]:
        return HostileHandler

    def fake(self, repo_id: str, repo: FakeRepo) -> FakeRepo:
        self.fakes[repo_id] = repo
        return repo


class HostileHandler(FaultyHandler):
    owner: HostileHub

    def _serve(self) -> None:
        hub = self.owner
        with hub._lock:
            hub.auth_seen.append((self.path, self.headers.get("Authorization")))
        path = unquote(urlsplit(self.path).path)
        if (m := _API.match(path)) and (fake := hub.fakes.get(m["repo"])):
            self._fake_api(fake)
            return
        if m := _RESOLVE.match(path):
            if (where := hub.redirects.get(m["file"])) is not None:
                self.send_response(302)
                self.send_header("Location", where)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if (fake := hub.fakes.get(m["repo"])) and (body := fake.files.get(m["file"]) or
                                                      fake.unlisted.get(m["file"])):
                self._fake_file(m["file"], body)
                return
        for fake in hub.fakes.values():  # whatever URL a lie about the commit made: a hub answers it
            if rel := next((r for r in fake.files if path.endswith("/" + r)), None):
                self._fake_file(rel, fake.files[rel])
                return
        super()._serve()

    def _fake_api(self, fake: FakeRepo) -> None:
        siblings = [sibling(rel, body) for rel, body in fake.files.items()] + fake.extra_siblings
        body = json.dumps({"id": "fake", "sha": fake.commit, "siblings": siblings}).encode()
        if not fake.api_runs_on:
            self._json(json.loads(body))
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.close_connection = True
        filler = b'{"rfilename": "x.json", "size": 1},' * 4096
        self._pour(b'{"sha": "' + fake.commit.encode() + b'", "siblings": [', "api", fake.api_runs_on, filler)

    def _fake_file(self, rel: str, body: Body) -> None:
        start, end, status = byte_span(self.headers.get("Range"), body.size)
        if start >= body.size and status == 206:
            self.send_response(416)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(status)
        self.send_header("ETag", f'"{body.sha256}"')
        self.send_header("Content-Type", "application/octet-stream")
        runs_on = body.runs_on if status == 200 and self.command == "GET" else 0
        if runs_on and not body.announce:
            self.close_connection = True  # the body ends when the connection does: never, here
        else:
            self.send_header("Content-Length", str(end - start + 1 + runs_on))
        self.end_headers()
        if self.command == "HEAD":
            return
        pos = start
        try:
            while pos <= end:
                chunk = body.read(pos, min(PIECE, end + 1 - pos))
                self._count(rel, chunk)
                pos += len(chunk)
            if runs_on:
                self._pour(b"", rel, runs_on, bytes(PIECE))
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _pour(self, first: bytes, rel: str, limit: int, filler: bytes) -> None:
        """`first`, then `filler` over and over, until `limit` bytes or the client hangs up."""
        try:
            self._count(rel, first)
            poured = len(first)
            while poured < limit:
                chunk = filler[:limit - poured]
                self._count(rel, chunk)
                poured += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _count(self, rel: str, chunk: bytes) -> None:
        self.wfile.write(chunk)
        with self.owner._lock:
            self.owner.sent[rel] += len(chunk)


class Recorder(BackgroundServer):
    """Any host at all: answers every request 404 and records its path and Authorization header (a
    redirect's target, a mirror a test watches)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        super().__init__(host, port)
        self.seen: list[tuple[str, str | None]] = []

    @property
    def handler(self) -> type[BaseHTTPRequestHandler]:
        return _RecorderHandler


class _RecorderHandler(BaseHTTPRequestHandler):
    owner: Recorder
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.owner.seen.append((self.path, self.headers.get("Authorization")))
        body = b'{"error": "not here"}'
        self.send_response(404)
        self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET
