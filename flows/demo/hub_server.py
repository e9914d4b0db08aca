"""A Hugging Face Hub look-alike on 127.0.0.1, serving model repos from a local folder.

The real huggingface_hub client code (model_info, hf_hub_download, range requests) runs against it
through HF_ENDPOINT, so the demo and the tests exercise the same download path as production. It
speaks the parts of the Hub protocol those calls use: /api/models/{repo}[/revision/{rev}] with
blobs, and /{repo}/resolve/{rev}/{file} with HEAD, ETag, X-Repo-Commit and byte ranges.

It only serves. The tests' hub that misbehaves on request (faults, tokens, throttling, a request
log) subclasses it among the tests, which are not installed.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tasks.mirror import BackgroundServer, byte_span

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # no `..`, no `.` alone: a folder under root
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/.*)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()



class LocalRepo:
    """One repo folder: its files, their hashes and a commit sha derived from them."""

    def __init__(self, repo_id: str, folder: Path):
        self.repo_id = repo_id
        self.folder = folder
        self.files: dict[str, dict] = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            rel = path.relative_to(folder).as_posix()
            entry: dict = {"rfilename": rel, "size": path.stat().st_size}
            if rel.endswith(LFS_SUFFIXES):
                sha = _sha256(path)
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {entry['size']}\n"
                entry["blobId"] = _git_blob_id(pointer.encode())
                entry["lfs"] = {"size": entry["size"], "sha256": sha, "pointerSize": len(pointer)}
            else:
                entry["blobId"] = _git_blob_id(path.read_bytes())
            self.files[rel] = entry
        listing = json.dumps(sorted((k, v["blobId"]) for k, v in self.files.items()))
        self.commit = hashlib.sha1(listing.encode()).hexdigest()

    def etag(self, rel: str) -> str:
        entry = self.files[rel]
        return entry["lfs"]["sha256"] if "lfs" in entry else entry["blobId"]


class LocalHub(BackgroundServer):
    """Serves every <org>/<name> folder under root as a model repo with one revision, "main"."""

    def __init__(self, root: Path, host: str = "127.0.0.1", port: int = 0):
        self.root = root
        self._repos: dict[str, LocalRepo] = {}
        self._lock = threading.Lock()
        super().__init__(host, port)

    @property
    def handler(self) -> type["HubHandler"]:
        return HubHandler

    def repo(self, repo_id: str) -> LocalRepo | None:
        """The repo folder under root, or None: a repo id from the URL (`%2e%2e/%2e%2e`, decoded)
        never names a folder elsewhere, which the hub would hash whole and then serve from."""
        if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id:
            return None
        folder = self.root / repo_id
        if not folder.is_dir() or self.root.resolve() not in folder.resolve().parents:
            return None
        with self._lock:
            if repo_id not in self._repos:
                self._repos[repo_id] = LocalRepo(repo_id, folder)
            return self._repos[repo_id]

    def refresh(self) -> None:
        """Forget cached hashes after the repo folders changed (a new 'commit')."""
        with self._lock:
            self._repos.clear()


class HubHandler(BaseHTTPRequestHandler):
    owner: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # keep demo and test output readable
        pass

    def _error(self, status: int, code: str, message: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _lookup(self, repo_id: str, rev: str | None) -> LocalRepo | None:
        repo = self.owner.repo(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        if rev not in (None, "main", repo.commit):
            self._error(404, "RevisionNotFound", f"Revision {rev} not found")
            return None
        return repo

    def _json(self, value) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def _serve(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if m := _API.match(path):
            repo = self._lookup(m["repo"], m["rev"])
            if repo:
                self._json({"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit, "private": False,
                            "siblings": list(repo.files.values())})
            return
        if m := _TREE.match(path):  # list_repo_tree, as snapshot_download (`hf download`) asks for it
            repo = self._lookup(m["repo"], m["rev"])
            if repo:
                entries = [{"type": "file", "oid": e["blobId"], "size": e["size"], "path": e["rfilename"]}
                           | ({"lfs": {"oid": e["lfs"]["sha256"], "size": e["size"],
                                       "pointerSize": e["lfs"]["pointerSize"]}} if "lfs" in e else {})
                           for e in repo.files.values()]
                self._json(entries)
            return
        if m := _RESOLVE.match(path):
            repo = self._lookup(m["repo"], m["rev"])
            if repo:
                self._send_file(repo, m["file"])
            return
        self._error(404, "NotFound", f"no route for {path}")

    def _span(self, size: int) -> tuple[int, int, int]:
        return byte_span(self.headers.get("Range"), size)

    def _answered(self, rel: str, start: int, status: int) -> None:
        """Called once per file request with what it got; the tests' hub logs it."""

    def _send_file(self, repo: LocalRepo, rel: str) -> None:
        if rel not in repo.files:
            self._error(404, "EntryNotFound", f"{rel} does not exist in {repo.repo_id}")
            return
        size = repo.files[rel]["size"]
        start, end, status = self._span(size)
        if start >= size and status == 206:
            self._answered(rel, start, 416)
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._answered(rel, start, status)
        self.send_response(status)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{repo.etag(rel)}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with (repo.folder / rel).open("rb") as fh:
            fh.seek(start)
            self._write_body(fh, rel, start, end)

    def _write_body(self, fh, rel: str, start: int, end: int) -> None:
        pos = start
        while pos <= end and (chunk := fh.read(min(1 << 20, end + 1 - pos))):
            self.wfile.write(chunk)
            pos += len(chunk)


def main() -> None:
    """Serve ROOT (argv[1]) on PORT (argv[2], default any) in its own process, for benchmarks."""
    import sys

    root, port = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
    hub = LocalHub(root, port=port)
    print(hub.endpoint, flush=True)
    hub.server.serve_forever()


if __name__ == "__main__":
    main()
