"""Model files from the Hugging Face Hub, pinned to one commit, resumable and verified in flight.

The revision is resolved to a commit sha once, and every file is fetched at that sha, so a push to
the branch mid-download cannot mix two versions of a model. Files land in the HF cache layout under
the models root (blobs named by their hash, snapshot symlinks), where huggingface_hub's own tools
list and delete them. hf_hub_download cannot be used as is: it neither resumes across runs (its
partial files are unique per call and deleted on failure) nor hashes while it writes, and a second
pass over 595 GB costs minutes. So the bytes come through huggingface_hub's own HTTP layer (its
session, Retry-After on 429, the Hub's error mapping) into a file object that hashes what it writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from huggingface_hub import constants, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from tasks.errors import (
    ChecksumError,
    DiskSpaceError,
    HubError,
    HubUnreachable,
    IncompleteDownload,
    RolloutError,
    first_line,
)
from tasks.hub_wire import HashingFile, RepoFile, model_info, repo_file
from tasks.trust import check_commit, check_filename, check_tree, env_secret, inside, shown

PART_SUFFIX = ".part"  # bytes of a blob still coming in; never visible under snapshots/
MIRROR_TOKEN_ENV = "ROLLOUT_MIRROR_TOKEN"  # the fleet's shared mirror token; never the HF token
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def unreachable(exc: HTTPError, endpoint: str | None) -> HubUnreachable:
    """The transport error as one line that names the endpoint and what went wrong."""
    url = (endpoint or constants.ENDPOINT).rstrip("/")
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    low = detail.lower()
    if "timeout" in type(exc).__name__.lower() or "timed out" in low:
        what = f"no answer within {constants.HF_HUB_DOWNLOAD_TIMEOUT} s (HF_HUB_DOWNLOAD_TIMEOUT)"
    elif "ssl" in low or "certificate" in low or "tls" in low:
        what = "TLS handshake failed"
    elif "name or service not known" in low or "name resolution" in low or "nodename" in low or "errno -" in low:
        what = "host name not resolved"
    elif "refused" in low:
        what = "connection refused"
    else:
        what = "network error"
    return HubUnreachable(f"Hub unreachable at {url}: {what} ({detail}); check the endpoint (--endpoint, HF_ENDPOINT)")


@contextlib.contextmanager
def reaching(endpoint: str | None) -> Iterator[None]:
    """Transport failures inside become HubUnreachable; the hub's own HTTP answers pass unchanged."""
    try:
        yield
    except HfHubHTTPError:
        raise
    except HTTPError as exc:
        raise unreachable(exc, endpoint) from exc


@dataclass(frozen=True)
class RepoSnapshot:
    repo_id: str
    revision: str
    commit: str
    files: tuple[RepoFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class FetchResult:
    path: str
    size: int
    downloaded: int  # bytes that crossed the network in the try that finished it (0: the blob was there)
    resumed_from: int  # bytes earlier tries, or an earlier run, had left in the partial file
    seconds: float
    source: str = "hub"  # where the bytes came from: "hub", "mirror", or "cache" (nothing fetched)
    mirror_error: str | None = None  # why the mirror's copy was not used, when one was tried

    @property
    def mb_per_s(self) -> float:
        return self.downloaded / 1e6 / self.seconds if self.downloaded and self.seconds > 0 else 0.0


def _access_error(exc: HfHubHTTPError, what: str) -> HubError | None:
    status = exc.response.status_code if exc.response is not None else None
    if isinstance(exc, GatedRepoError):
        return HubError(f"{what} is gated: accept its terms on the Hub and set HF_TOKEN or hf_token_secret")
    if status in (401, 403):
        return HubError(f"{what}: access denied (HTTP {status}): set HF_TOKEN or hf_token_secret to a token "
                        "that can read this repo")
    return None


def resolve_snapshot(repo_id: str, revision: str, endpoint: str | None = None) -> RepoSnapshot:
    """One model_info call: the commit sha and every file's size and hash at that commit, each
    checked before it names a folder, a path or a blob (tasks/trust.py)."""
    url = (endpoint or constants.ENDPOINT).rstrip("/")
    try:
        with reaching(endpoint):  # huggingface_hub sets no deadline of its own: a silent hub would hang
            info = model_info(repo_id, revision, url)
    except RevisionNotFoundError as exc:
        raise HubError(f"revision {revision!r} not found in repo {repo_id}") from exc
    except HfHubHTTPError as exc:
        if denied := _access_error(exc, f"repo {repo_id}"):
            raise denied from exc
        if isinstance(exc, RepositoryNotFoundError):
            raise HubError(f"repo {repo_id} not found on {url} (private repos need HF_TOKEN)") from exc
        raise
    where = f"the hub at {url}, for {repo_id}@{revision}"
    if not info.get("sha"):
        raise HubError(f"hub returned no commit sha for {repo_id}@{revision}")
    commit = check_commit(info["sha"], where=f"the hub at {url}")
    siblings = info.get("siblings") or []
    if not isinstance(siblings, list):
        raise HubError(f"{where}: siblings is not a list")
    files = tuple(repo_file(s, where) for s in siblings)
    check_tree([f.path for f in files], where=where)
    return RepoSnapshot(repo_id=repo_id, revision=revision, commit=commit, files=files)


def repo_dir(repo_id: str, cache_dir: Path) -> Path:
    return cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")


def snapshot_dir(snapshot: RepoSnapshot, cache_dir: Path) -> Path:
    """The directory vLLM is pointed at: the cache's snapshot folder for the pinned commit."""
    return repo_dir(snapshot.repo_id, cache_dir) / "snapshots" / snapshot.commit


def _blob(snapshot: RepoSnapshot, file: RepoFile, cache_dir: Path) -> Path:
    return repo_dir(snapshot.repo_id, cache_dir) / "blobs" / file.etag


def cached_path(snapshot: RepoSnapshot, file: RepoFile, cache_dir: Path) -> Path | None:
    """The file's path when this exact commit already holds it complete, else None."""
    found = try_to_load_from_cache(snapshot.repo_id, file.path, cache_dir=cache_dir, revision=snapshot.commit)
    if isinstance(found, str) and Path(found).stat().st_size == file.size:
        return Path(found)
    return None


def _partial_size(snapshot: RepoSnapshot, file: RepoFile, cache_dir: Path) -> int:
    part = _blob(snapshot, file, cache_dir).with_name(file.etag + PART_SUFFIX)
    return min(part.stat().st_size, file.size) if part.exists() else 0


def missing_bytes(snapshot: RepoSnapshot, cache_dir: Path) -> int:
    """What still has to come down: a re-run after success needs nothing, a resumed one the rest."""
    return sum(f.size - _partial_size(snapshot, f, cache_dir) for f in snapshot.files
               if cached_path(snapshot, f, cache_dir) is None)


def _link(snapshot: RepoSnapshot, file: RepoFile, blob: Path, cache_dir: Path) -> Path:
    """Snapshot entry -> blob, relative like huggingface_hub's, so the cache can move as a whole.
    Its folder is made only once it resolves inside the snapshot folder, and a link that could not
    take its place is removed: nothing is left outside the models root, nor beside the entry."""
    snap = snapshot_dir(snapshot, cache_dir)
    pointer = snap / check_filename(file.path)
    inside(snap, pointer.parent, what=f"{file.path}: its folder")
    pointer.parent.mkdir(parents=True, exist_ok=True)
    inside(snap, pointer.parent, what=f"{file.path}: its folder")  # no symlinked folder on the way
    target = os.path.relpath(blob, pointer.parent)
    if pointer.is_symlink() and os.readlink(pointer) == target:
        return pointer
    tmp = pointer.with_name(pointer.name + ".link")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(target, tmp)
        os.replace(tmp, pointer)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise HubError(f"{shown(file.path)}: cannot link it into {snap} ({exc.strerror})") from exc
    return pointer


def _stream(url: str, sink: HashingFile, file: RepoFile, *, token: bool = True) -> None:
    """One GET of the rest of the file into sink, from the bytes already on disk, and never a byte
    past the size the hub published: a body that runs on is cut there, not written to the disk.

    A reset, a short body, a 5xx or a 429 ends this try with a transient error; the fetch task's
    retries (tasks/orchestration/steps.py) are the only retry budget, and each try resumes here. A 429's
    Retry-After is waited out first, so the next try comes no sooner than the hub asked.
    Chunks are written as the socket yields them: http_get re-buffers every 10 MiB (a copy per
    byte, and up to 10 MiB lost on a reset), which the hash cannot afford on 2 cores.
    The HF token goes only with `token` (the hub's own requests; a mirror gets the fleet's mirror
    token instead), and huggingface_hub's client drops it on a redirect to another origin.
    """
    start = sink.tell()
    auth = build_hf_headers() if token else build_hf_headers(token=False) | _mirror_auth()
    headers = auth | ({"Range": f"bytes={start}-"} if start else {})
    source = url.split("/", 3)[2] if "://" in url else url
    with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
        if response.status_code == 429:
            time.sleep(_retry_after_s(response.headers.get("Retry-After")))
        hf_raise_for_status(response)
        if start and response.status_code == 200:  # the server ignored the range: start over
            sink.truncate(0)
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and not response.headers.get("Content-Encoding") and \
                sink.tell() + int(declared) > file.size:
            raise ChecksumError(f"{file.path}: {source} announced {int(declared):,} bytes from byte {sink.tell():,}, "
                                f"past the {file.size:,} bytes the hub published; not read")
        for chunk in response.iter_bytes():
            if sink.tell() + len(chunk) > file.size:
                raise ChecksumError(f"{file.path}: {source} sent more than the {file.size:,} bytes the hub "
                                    "published; stopped reading there, deleted")
            sink.write(chunk)
    if sink.tell() < file.size:
        raise IncompleteDownload(f"{file.path}: stream ended at {sink.tell():,} of {file.size:,} bytes; "
                                 "the next try resumes there")


def _mirror_auth() -> dict[str, str]:
    """The fleet's shared mirror token (ROLLOUT_MIRROR_TOKEN), where one is set: what a mirror that
    listens beyond loopback asks of its clients (tasks/mirror.py)."""
    token = env_secret(MIRROR_TOKEN_ENV)
    return {"authorization": f"Bearer {token}"} if token else {}


def _retry_after_s(value: str | None, cap_s: float = 60.0) -> float:
    """Retry-After in seconds (the hub sends seconds), capped so a bad header cannot stall a fetch."""
    try:
        return min(max(float(value), 0.0), cap_s) if value else 1.0
    except ValueError:
        return 1.0


def fetch_file(snapshot: RepoSnapshot, file: RepoFile, cache_dir: Path, *, endpoint: str | None = None,
               on_bytes: Callable[[int], None] = lambda n: None, mirror: str | None = None) -> FetchResult:
    """Fetch one file at the pinned commit into the HF cache; only verified bytes get a blob name.

    With a mirror (another host's `rollout mirror`), its copy is tried first and held to the hash the
    Hub published, as the Hub's own would be. Whatever goes wrong there (a flipped byte, a reset, a
    404, a mirror that is down) costs that file one fetch from the Hub, and the result says why.
    A partial file from an earlier try or run is resumed. A hash mismatch, a disk that fills up or
    a permanent hub error deletes the partial file: what the cache holds is complete or absent.
    """
    start = time.perf_counter()
    if not file.etag:
        raise HubError(f"{snapshot.repo_id}@{snapshot.commit[:12]}: {file.path} has no hash on the hub")
    blob = _blob(snapshot, file, cache_dir)
    blob.parent.mkdir(parents=True, exist_ok=True)
    part = blob.with_name(file.etag + PART_SUFFIX)
    mirror_error = None
    with FileLock(str(blob.with_name(file.etag + ".lock"))):
        if blob.exists() and blob.stat().st_size == file.size:  # renamed only once verified
            _link(snapshot, file, blob, cache_dir)
            return FetchResult(file.path, file.size, downloaded=0, resumed_from=0, seconds=time.perf_counter() - start,
                               source="cache")
        if mirror:
            try:
                resumed = _download(snapshot, file, part, endpoint=mirror, on_bytes=on_bytes, token=False)
                source = "mirror"
            except DiskSpaceError:
                raise
            except (RolloutError, OSError) as exc:  # HTTP and transport errors are OSErrors too
                mirror_error = first_line(exc)
                part.unlink(missing_ok=True)  # a partial copy from the mirror cannot be vouched for
        if mirror_error or not mirror:
            resumed = _download(snapshot, file, part, endpoint=endpoint, on_bytes=on_bytes)
            source = "hub"
        os.replace(part, blob)
    _link(snapshot, file, blob, cache_dir)
    return FetchResult(file.path, file.size, downloaded=file.size - resumed, resumed_from=resumed,
                       seconds=time.perf_counter() - start, source=source, mirror_error=mirror_error)


def _download(snapshot: RepoSnapshot, file: RepoFile, part: Path, *, endpoint: str | None,
              on_bytes: Callable[[int], None], token: bool = True) -> int:
    """The rest of the file from `endpoint` into `part`, verified; returns the bytes it resumed from.
    `token`: whether the HF token may go there (the hub: yes; a mirror: never)."""
    url = hf_hub_url(snapshot.repo_id, file.path, revision=snapshot.commit, endpoint=endpoint)
    with part.open("ab+") as fh:
        if fh.seek(0, os.SEEK_END) > file.size:
            fh.truncate(0)
        sink = HashingFile(fh, file, on_bytes)
        try:
            with reaching(endpoint):
                _stream(url, sink, file, token=token)
        except ChecksumError:
            part.unlink(missing_ok=True)  # more than was published: none of it can be vouched for
            raise
        except HfHubHTTPError as exc:
            denied = exc.response is not None and exc.response.status_code == 401
            permanent = (HubError(f"the mirror at {endpoint} asks for the fleet's mirror token: set {MIRROR_TOKEN_ENV} "
                                  "as on the mirror's host") if denied and not token else None) or _access_error(
                exc, f"{snapshot.repo_id}: {file.path}") or (
                HubError(f"{snapshot.repo_id}@{snapshot.commit[:12]}: {file.path} not found")
                if isinstance(exc, (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError))
                else None)
            if permanent:
                part.unlink(missing_ok=True)
                raise permanent from exc
            raise  # 5xx or 429: the task retries
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                done = fh.tell()
                part.unlink(missing_ok=True)
                raise DiskSpaceError(f"{file.path}: disk full after {done:,} of {file.size:,} bytes in "
                                     f"{part.parent} ({os.strerror(exc.errno)}); partial file deleted") from exc
            raise
        actual = sink.hasher.hexdigest()
        size = fh.tell()
    if size != file.size or actual != file.etag:
        part.unlink(missing_ok=True)
        source = (endpoint or constants.ENDPOINT).rstrip("/")
        raise ChecksumError(f"{file.path}: {size:,} bytes from {source} hashing to {actual[:12]}, the hub "
                            f"published {file.size:,} bytes hashing to {file.etag[:12]}; deleted, will fetch again")
    return sink.resumed_from


def record_revision(snapshot: RepoSnapshot, cache_dir: Path) -> None:
    """refs/<revision> -> commit once every file is in, as huggingface_hub keeps it: offline tools and
    the nightly check then know which commit "main" was."""
    if snapshot.revision == snapshot.commit:
        return
    refs = repo_dir(snapshot.repo_id, cache_dir) / "refs"
    ref = inside(refs, refs / snapshot.revision, what=f"revision {snapshot.revision!r}: its ref")
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(snapshot.commit)


def is_transient(exc: BaseException) -> bool:
    """Worth another try: network faults, 5xx and 429, a short stream, a checksum mismatch."""
    if isinstance(exc, HubUnreachable):
        return True
    if isinstance(exc, (HubError, DiskSpaceError, RepositoryNotFoundError, RevisionNotFoundError,
                        EntryNotFoundError)):
        return False
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        return status in (408, 429) or status >= 500
    # The HTTP client's own errors (huggingface_hub's HTTPError base) are transport faults here.
    return isinstance(exc, (ChecksumError, IncompleteDownload, HTTPError, ConnectionError, TimeoutError))
