"""A host's verified HF cache, served read-only over the Hub's file route to the hosts after it.

A fleet rollout reads the Hub once: the canary fetches from the Hub, and the hosts after it fetch
from the canary's mirror (`rollout mirror`), every file still held to the sha256 the Hub published
(tasks/hub.py). Chosen over a caching proxy such as olah because there is nothing to install or
keep consistent: the cache already holds exactly the pinned commit's verified files, since a blob
gets its name only once its hash matched and a snapshot entry only links such a blob.

It serves `GET|HEAD /{org}/{name}/resolve/{commit}/{path}` for full commit shas (never a branch: the
mirror has no say in which commit a host deploys), with byte ranges so a fetch resumes, and
`/health`. Nothing outside a repo's `blobs/` is ever read, and no partial `.part` file is visible.

Who may read it: the cache holds gated models fetched with this host's HF token, so a mirror that
listens beyond loopback asks for the fleet's shared token (ROLLOUT_MIRROR_TOKEN, the same on every
host: `Authorization: Bearer`), or serves anyone only when told so in as many words (`exposure`).
The clients (tasks/hub.py) send that token to the mirror, and never the HF token.
"""

from __future__ import annotations

import hmac
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tasks.errors import HubError, UnusableInput
from tasks.hub import MIRROR_TOKEN_ENV, check_filename, repo_dir
from tasks.trust import loopback

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<commit>[0-9a-f]{40})/(?P<file>.+)$")
CHUNK = 1 << 20


def byte_span(range_header: str | None, size: int) -> tuple[int, int, int]:
    """(first byte, last byte, status) of what a Range header asks for; 200 for the whole file, and
    (size, size - 1, 206) for a range that cannot be served (416): `bytes=-`, a last byte before
    the first, numbers of thousands of digits."""
    if range_header and (m := re.match(r"bytes=(\d{0,20})-(\d{0,20})$", range_header.strip())):
        if m[1]:
            start = int(m[1])
            end = min(int(m[2]), size - 1) if m[2] else size - 1
            return (start, end, 206) if end >= start else (size, size - 1, 206)
        if m[2]:
            return max(size - int(m[2]), 0), size - 1, 206  # suffix range: the last N bytes
        return size, size - 1, 206
    return 0, size - 1, 200


def exposure(host: str, port: int, *, token: str | None, anonymous: bool) -> str:
    """Who a mirror on host:port serves, in words, for its first line; refused where it would serve
    gated files to anyone who can reach a non-loopback address without being told so."""
    where = f"{host}:{port}"
    if token:
        return (f"to clients presenting the fleet's mirror token ({MIRROR_TOKEN_ENV}), "
                + ("on this machine only (loopback)" if loopback(host) else f"from any host that reaches {where}"))
    if loopback(host):
        return "to this machine only (loopback), no token asked"
    if not anonymous:
        raise UnusableInput(f"--host {host}: a mirror beyond loopback serves gated files fetched with this host's HF "
                            f"token; set {MIRROR_TOKEN_ENV} (the same on every host of the fleet) or pass --anonymous")
    return f"to ANYONE who reaches {where}, no token asked (--anonymous): gated models included"


class BackgroundServer:
    """An HTTP server on host:port, served from a thread of its own while in a `with` block; its
    handler reaches the server object as `self.owner`. The mirror and the demo's hub are both one."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.server = _Server((host, port), type("Handler", (self.handler,), {"owner": self}))
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that hangs up mid-body (a killed fetch) is routine here, not a traceback."""


class CacheMirror(BackgroundServer):
    """Serves the HF cache at `cache_dir` (models_root/hub) on host:port."""

    def __init__(self, cache_dir: Path, host: str = "127.0.0.1", port: int = 0,
                 log: Callable[[str], None] = lambda line: None, token: str | None = None):
        self.cache_dir = cache_dir
        self.log = log
        self.token = token  # where set, every file request must present it
        super().__init__(host, port)

    def served(self) -> list[str]:
        """repo@commit of every snapshot in the cache, what a client may ask for."""
        return sorted(f"{repo.name.removeprefix('models--').replace('--', '/')}@{snap.name[:12]}"
                      for repo in self.cache_dir.glob("models--*") for snap in (repo / "snapshots").glob("*"))

    def admits(self, authorization: str | None) -> bool:
        if not self.token:
            return True
        return hmac.compare_digest((authorization or "").encode(), f"Bearer {self.token}".encode())

    @property
    def handler(self) -> type[MirrorHandler]:
        return MirrorHandler

    def locate(self, repo_id: str, commit: str, rel: str) -> Path | None:
        """The verified blob behind a snapshot entry, or None: absent, or anything not a cache blob."""
        try:
            check_filename(rel)
            repo = repo_dir(repo_id, self.cache_dir).resolve()
        except (HubError, ValueError):
            return None
        entry = repo / "snapshots" / commit / rel
        target = entry.resolve()
        if not entry.is_symlink() or target.parent != repo / "blobs" or not target.is_file():
            return None
        return target


class MirrorHandler(BaseHTTPRequestHandler):
    owner: CacheMirror
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def _status(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        body = message.encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def _serve(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path == "/health":
            self._status(200, "ok")
            return
        if not self.owner.admits(self.headers.get("Authorization")):
            self._status(401, f"this mirror asks for the fleet's mirror token ({MIRROR_TOKEN_ENV})",
                         {"X-Error-Code": "Unauthorized"})
            return
        m = _RESOLVE.match(path)
        blob = m and self.owner.locate(m["repo"], m["commit"], m["file"])
        if not blob:
            self._status(404, f"{path}: not in this mirror (only verified files of pinned commits are)",
                         {"X-Error-Code": "EntryNotFound"})
            return
        size = blob.stat().st_size
        start, end, status = byte_span(self.headers.get("Range"), size)
        if start >= size and status == 206:
            self._status(416, "range not satisfiable", {"Content-Range": f"bytes */{size}"})
            return
        self.owner.log(f"{self.command} {m['repo']} {m['file']} bytes {start}-{end} of {size}")
        self.send_response(status)
        self.send_header("X-Repo-Commit", m["commit"])
        self.send_header("ETag", f'"{blob.name}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with blob.open("rb") as fh:
            fh.seek(start)
            self.send_body(fh, m["file"], start, end=end)

    def send_body(self, fh, rel: str, start: int, *, end: int) -> None:
        pos = start
        while pos <= end and (chunk := fh.read(min(CHUNK, end + 1 - pos))):
            self.wfile.write(chunk)
            pos += len(chunk)
