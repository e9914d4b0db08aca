"""What crosses the wire from a hub, before tasks/hub.py builds paths from it: the answer about a
commit, read to a bound and checked field by field, and the file object that hashes a body as it
lands. Apart from hub.py so that each stays readable (the house's 400-line rule).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

import orjson
from huggingface_hub import constants
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from tasks.errors import HubError
from tasks.trust import COMMIT, SHA256, check_filename, check_hash, check_size, read_bounded, shown

CHUNK = 8 * 1024 * 1024
# The Hub's answer about one commit: ~250 bytes a file, so 32 MiB holds the 100,000 files a repo may have.
MAX_API_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    sha256: str | None  # LFS files carry the sha256 of their content
    blob_id: str | None  # git blob sha1, for files stored in git itself

    @property
    def etag(self) -> str:
        """The name of its blob in the HF cache, as huggingface_hub names it."""
        return self.sha256 or self.blob_id or ""


def model_info(repo_id: str, revision: str, endpoint: str) -> dict:
    """huggingface_hub's model_info request (files_metadata), its body read to a bound: the library
    reads an answer whole, and a hub that never ends one would fill the memory."""
    url = f"{endpoint}/api/models/{repo_id}/revision/{quote(revision, safe='')}"
    with get_session().stream("GET", url, headers=build_hf_headers(), params={"blobs": True},
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
        hf_raise_for_status(response)
        body = read_bounded(response.iter_bytes(), limit=MAX_API_BYTES, what=f"{endpoint}: the answer about {repo_id}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HubError(f"{endpoint}: the answer about {repo_id}@{revision} is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise HubError(f"{endpoint}: the answer about {repo_id}@{revision} is not a JSON object")
    return data


def repo_file(entry: object, where: str) -> RepoFile:
    """One `siblings` entry, every field checked: its name becomes a path, its hash a blob name."""
    if not isinstance(entry, dict):
        raise HubError(f"{where}: a siblings entry is not an object")
    path = check_filename(entry.get("rfilename"))
    lfs = entry.get("lfs")
    if lfs is not None and not isinstance(lfs, dict):
        raise HubError(f"{where}: {shown(path)}: lfs is not an object")
    size = check_size(lfs.get("size") if lfs else (entry.get("size") or 0), where=f"{where}: {shown(path)}")
    return RepoFile(path=path, size=size,
                    sha256=check_hash(lfs.get("sha256"), SHA256, where=f"{where}: {shown(path)}") if lfs else None,
                    blob_id=check_hash(entry.get("blobId"), COMMIT, where=f"{where}: {shown(path)}"))


def new_hasher(file: RepoFile):
    if file.sha256:
        return hashlib.sha256()
    return hashlib.sha1(f"blob {file.size}\0".encode())  # git's blob id, for files kept in git


class HashingFile:
    """The partial file the stream writes into: each chunk is hashed and counted as it lands."""

    def __init__(self, fh, file: RepoFile, on_bytes: Callable[[int], None]):
        self._fh = fh
        self._file = file
        self._on_bytes = on_bytes
        self.hasher = new_hasher(file)
        fh.seek(0)
        while chunk := fh.read(CHUNK):  # what an earlier try left: read once, then only new bytes
            self.hasher.update(chunk)
        self.resumed_from = fh.tell()

    def write(self, data: bytes) -> int:
        self._fh.write(data)
        self.hasher.update(data)
        self._on_bytes(len(data))
        return len(data)

    def tell(self) -> int:
        return self._fh.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._fh.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        """The download starts over when a server ignores the Range header; so does the hash."""
        size = self._fh.truncate(size)
        self.resumed_from = min(self.resumed_from, size)
        self.hasher = new_hasher(self._file)
        self._fh.seek(0)
        while (done := self._fh.tell()) < size and (chunk := self._fh.read(min(CHUNK, size - done))):
            self.hasher.update(chunk)
        return size
