"""Model files from the Hugging Face Hub, pinned to one commit and verified.

The revision is resolved to a commit sha once, and every file is fetched at that sha, so a push to
the branch mid-download cannot mix two versions of a model. Files land in the HF cache layout under
the models root, where huggingface_hub's own tools can list and delete them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from prefect import task

CHUNK = 8 * 1024 * 1024


class HubError(RuntimeError):
    """A hub answer that retrying cannot change (missing repo, revision or file, no access)."""


class ChecksumError(RuntimeError):
    """Downloaded bytes differ from what the hub published; the file was deleted."""


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    sha256: str | None  # LFS files carry the sha256 of their content
    blob_id: str | None  # git blob sha1, for files stored in git itself


@dataclass(frozen=True)
class RepoSnapshot:
    repo_id: str
    revision: str
    commit: str
    files: tuple[RepoFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def check_filename(path: str) -> str:
    """Reject names that would write outside the snapshot directory."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path or path.startswith("~"):
        raise HubError(f"hub file name {path!r} is unsafe: it would land outside the model directory")
    return path


def resolve_snapshot(repo_id: str, revision: str, endpoint: str | None = None) -> RepoSnapshot:
    """One model_info call: the commit sha and every file's size and hash at that commit."""
    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except GatedRepoError as exc:
        raise HubError(f"repo {repo_id} is gated: accept its terms and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise HubError(f"repo {repo_id} not found on {api.endpoint} (private repos need HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise HubError(f"revision {revision!r} not found in repo {repo_id}") from exc
    if not info.sha:
        raise HubError(f"hub returned no commit sha for {repo_id}@{revision}")
    files = tuple(
        RepoFile(
            path=check_filename(s.rfilename),
            size=s.lfs.size if s.lfs else (s.size or 0),
            sha256=s.lfs.sha256 if s.lfs else None,
            blob_id=s.blob_id,
        )
        for s in info.siblings or []
    )
    return RepoSnapshot(repo_id=repo_id, revision=revision, commit=info.sha, files=files)


def cached_path(snapshot: RepoSnapshot, file: RepoFile, cache_dir: Path) -> Path | None:
    """The file's path when this exact commit already holds it complete, else None."""
    found = try_to_load_from_cache(snapshot.repo_id, file.path, cache_dir=cache_dir, revision=snapshot.commit)
    if isinstance(found, str) and Path(found).stat().st_size == file.size:
        return Path(found)
    return None


def missing_bytes(snapshot: RepoSnapshot, cache_dir: Path) -> int:
    """What still has to come down: a re-run after success needs no space at all."""
    return sum(f.size for f in snapshot.files if cached_path(snapshot, f, cache_dir) is None)


def _digest(path: Path, file: RepoFile) -> tuple[str, str]:
    if file.sha256:
        h = hashlib.sha256()
        expected = file.sha256
    else:
        h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
        expected = file.blob_id or ""
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest(), expected


def verify(path: Path, file: RepoFile) -> None:
    """Compare with the hub's hash; a mismatching file is deleted so no run ever serves it."""
    actual, expected = _digest(path, file)
    if expected and actual != expected:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise ChecksumError(f"{file.path}: hash {actual[:12]} does not match the hub's {expected[:12]}; deleted")


def fetch_file(snapshot: RepoSnapshot, file: RepoFile, cache_dir: Path, endpoint: str | None = None) -> Path:
    """Download one file at the pinned commit into the HF cache and verify it."""
    try:
        local = Path(
            hf_hub_download(
                snapshot.repo_id,
                file.path,
                revision=snapshot.commit,
                cache_dir=cache_dir,
                endpoint=endpoint,
            )
        )
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise HubError(f"{snapshot.repo_id}@{snapshot.commit[:12]}: {file.path} not found") from exc
    verify(local, file)
    return local


def snapshot_dir(snapshot: RepoSnapshot, cache_dir: Path) -> Path:
    """The directory vLLM is pointed at: the cache's snapshot folder for the pinned commit."""
    org_name = snapshot.repo_id.replace("/", "--")
    return cache_dir / f"models--{org_name}" / "snapshots" / snapshot.commit


def is_transient(exc: BaseException) -> bool:
    """Worth another try: network faults, 5xx and 429, and a checksum mismatch (bytes refetched)."""
    if isinstance(exc, (HubError, RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
        return False
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        return status == 429 or status >= 500
    # The HTTP client's own errors (huggingface_hub's HTTPError base) are transport faults here.
    return isinstance(exc, (ChecksumError, HTTPError, ConnectionError, TimeoutError))


def _retry_transient(task, task_run, state) -> bool:
    return is_transient(state.result(raise_on_failure=False))


@task(name="resolve-revision", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=_retry_transient)
def resolve_snapshot_task(repo_id: str, revision: str, endpoint: str | None = None) -> RepoSnapshot:
    return resolve_snapshot(repo_id, revision, endpoint)


@task(
    name="fetch-file",
    task_run_name="fetch {file.path}",
    tags=["hub-download"],
    retries=4,
    retry_delay_seconds=[2, 10, 30, 60],
    retry_condition_fn=_retry_transient,
)
def fetch_file_task(snapshot: RepoSnapshot, file: RepoFile, cache_dir: Path, endpoint: str | None = None) -> Path:
    return fetch_file(snapshot, file, cache_dir, endpoint)
