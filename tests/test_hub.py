"""Fetching through the real huggingface_hub client from the local Hub look-alike, with faults.

Every test ends by checking the one invariant that matters for a 595 GB refresh: what the cache
holds is complete and matches the hub's hash, or it is absent. Partial bytes only ever live in a
blob's `.part` file, which no snapshot points at.
"""

from __future__ import annotations

import hashlib
import importlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIG, BIG_SIZE, SHARD
from conftest import SHARDED_REPO as REPO
from huggingface_hub.errors import HfHubHTTPError, Response

from tasks.errors import ChecksumError, DiskSpaceError, HubError
from tasks.hub import (
    PART_SUFFIX,
    RepoSnapshot,
    check_filename,
    fetch_file,
    is_transient,
    missing_bytes,
    resolve_snapshot,
    snapshot_dir,
)
from tasks.orchestration.steps import fetch
from testkit.faulty_hub import Fault

CHUNK = 10 * 2**20


def _shard(snap: RepoSnapshot, n: int = 1):
    name = BIG if n == 0 else f"model-0000{n}-of-00003.safetensors"
    return next(f for f in snap.files if f.path == name)


def assert_complete_or_absent(snap: RepoSnapshot, cache: Path, source: Path) -> None:
    for f in snap.files:
        pointer = snapshot_dir(snap, cache) / f.path
        if pointer.exists():
            assert pointer.read_bytes() == (source / f.path).read_bytes(), f"{f.path} is corrupt"
    for blob in cache.rglob("blobs/*"):
        if blob.suffix in (PART_SUFFIX, ".lock"):
            continue
        data = blob.read_bytes()
        git = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
        assert blob.name in (hashlib.sha256(data).hexdigest(), git), f"blob {blob.name} does not hold its hash"


def test_fetch_pins_the_commit_verifies_and_a_rerun_downloads_nothing(hub, fetch_root, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    assert len(snap.commit) == 40 and len(snap.files) == 5
    assert all(f.sha256 for f in snap.files if f.path.endswith(".safetensors"))
    cache = tmp_path / "hub"
    assert missing_bytes(snap, cache) == snap.total_bytes
    results = [fetch_file(snap, f, cache, endpoint=hub.endpoint) for f in snap.files]
    assert sum(r.downloaded for r in results) == snap.total_bytes
    assert_complete_or_absent(snap, cache, fetch_root / REPO)
    assert missing_bytes(snap, cache) == 0
    sent = hub.file_bytes_sent
    again = [fetch_file(snap, f, cache, endpoint=hub.endpoint) for f in snap.files]
    assert hub.file_bytes_sent == sent and all(r.downloaded == 0 for r in again)


@pytest.mark.parametrize("kind", ["reset", "close"])
def test_connection_cut_mid_shard_resumes_from_the_bytes_received(prefect_server, hub, fetch_root, tmp_path, kind):
    """A TCP reset, or a clean close short of Content-Length (a truncated body): the task's next try."""
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    shard = _shard(snap, 0)
    hub.inject(shard.path, Fault(kind, after_bytes=CHUNK + CHUNK // 2))
    result = fetch.with_options(retry_delay_seconds=0.1, retry_jitter_factor=None)(
        snap, shard, tmp_path / "hub", endpoint=hub.endpoint)
    gets = [r for r in hub.requests if r.path == shard.path]
    # resumed from the bytes that arrived, not from 0
    assert len(gets) == 2 and gets[0].range_start == 0 and 0 < gets[1].range_start <= CHUNK + CHUNK // 2
    assert result.resumed_from == gets[1].range_start and result.resumed_from + result.downloaded == BIG_SIZE
    assert_complete_or_absent(snap, tmp_path / "hub", fetch_root / REPO)
    assert (snapshot_dir(snap, tmp_path / "hub") / shard.path).exists()


def test_429_waits_for_retry_after_then_fetches(prefect_server, hub, fetch_root, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    shard = _shard(snap)
    hub.inject(shard.path, Fault("status", status=429, retry_after=1))
    started = time.monotonic()
    fetch.with_options(retry_delay_seconds=0, retry_jitter_factor=None)(snap, shard, tmp_path / "hub",
                                                                        endpoint=hub.endpoint)
    assert time.monotonic() - started >= 1.0
    assert [r.status for r in hub.requests if r.path == shard.path] == [429, 200]
    assert_complete_or_absent(snap, tmp_path / "hub", fetch_root / REPO)


def test_corrupted_bytes_are_deleted_and_fetched_again_by_the_task_retry(prefect_server, hub, fetch_root, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    shard = _shard(snap)
    cache = tmp_path / "hub"
    hub.inject(shard.path, Fault("corrupt", after_bytes=12345))
    with pytest.raises(ChecksumError, match="deleted, will fetch again") as info:
        fetch_file(snap, shard, cache, endpoint=hub.endpoint)
    assert is_transient(info.value)
    assert not list(cache.rglob(f"*{PART_SUFFIX}")) and not (snapshot_dir(snap, cache) / shard.path).exists()
    hub.inject(shard.path, Fault("corrupt", after_bytes=99))
    result = fetch.with_options(retry_delay_seconds=0.1, retry_jitter_factor=None)(
        snap, shard, cache, endpoint=hub.endpoint)
    assert result.downloaded == SHARD
    assert_complete_or_absent(snap, cache, fetch_root / REPO)
    assert (snapshot_dir(snap, cache) / shard.path).read_bytes() == (fetch_root / REPO / shard.path).read_bytes()


def test_server_errors_are_retried_by_the_task_and_keep_the_partial_bytes(prefect_server, hub, fetch_root, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    shard = _shard(snap)
    cache = tmp_path / "hub"
    hub.inject(shard.path, Fault("status", status=500), Fault("status", status=503))
    result = fetch.with_options(retry_delay_seconds=0.1, retry_jitter_factor=None)(
        snap, shard, cache, endpoint=hub.endpoint)
    assert [r.status for r in hub.requests if r.path == shard.path] == [500, 503, 200]
    assert result.downloaded == SHARD
    assert_complete_or_absent(snap, cache, fetch_root / REPO)


def test_missing_file_is_a_clear_error_not_retried(hub, fetch_root, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    ghost = type(_shard(snap))(path="model-00009-of-00003.safetensors", size=10, sha256="0" * 64, blob_id=None)
    with pytest.raises(HubError, match="model-00009-of-00003.safetensors not found") as info:
        fetch_file(snap, ghost, tmp_path / "hub", endpoint=hub.endpoint)
    assert not is_transient(info.value)
    assert not list((tmp_path / "hub").rglob(f"*{PART_SUFFIX}"))


def test_401_names_the_token_and_is_not_retried(hub, fetch_root, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    hub.require_token = "hf_test_secret"
    with pytest.raises(HubError, match=r"access denied \(HTTP 401\): set HF_TOKEN") as info:
        resolve_snapshot(REPO, "main", hub.endpoint)
    assert not is_transient(info.value)
    with pytest.raises(HubError, match="access denied"):
        fetch_file(snap, _shard(snap), tmp_path / "hub", endpoint=hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_test_secret")
    fetch_file(snap, _shard(snap), tmp_path / "hub", endpoint=hub.endpoint)
    assert_complete_or_absent(snap, tmp_path / "hub", fetch_root / REPO)


_FETCH_IN_CHILD = """
import resource, signal, sys
from pathlib import Path
from tasks.hub import fetch_file, resolve_snapshot
endpoint, cache, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
if limit:  # the kernel refuses writes past this size: EFBIG, what a full quota looks like to a writer
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
snap = resolve_snapshot("org/sharded", "main", endpoint)
for f in sorted(snap.files, key=lambda f: f.size):  # the flow's order: small files first
    try:
        fetch_file(snap, f, cache, endpoint=endpoint)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
        sys.exit(3)
"""


def test_disk_full_mid_download_deletes_the_partial_file(hub, fetch_root, tmp_path):
    cache = tmp_path / "hub"
    proc = subprocess.run([sys.executable, "-c", _FETCH_IN_CHILD, hub.endpoint, str(cache), str(SHARD // 3)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith(DiskSpaceError.__name__) and "partial file deleted" in proc.stdout
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    assert not list(cache.rglob(f"*{PART_SUFFIX}"))
    assert not (snapshot_dir(snap, cache) / _shard(snap).path).exists()
    assert (snapshot_dir(snap, cache) / "config.json").exists()  # what fit is complete
    assert_complete_or_absent(snap, cache, fetch_root / REPO)


def test_killed_fetch_resumes_instead_of_downloading_again(hub, fetch_root, tmp_path):
    cache = tmp_path / "hub"
    hub.throttle_bps = 8 * 2**20  # the big file takes about 3 s
    proc = subprocess.Popen([sys.executable, "-c", _FETCH_IN_CHILD, hub.endpoint, str(cache), "0"])
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    big = _shard(snap, 0)
    part = cache / f"models--{REPO.replace('/', '--')}" / "blobs" / (big.etag + PART_SUFFIX)
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size >= CHUNK) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    held = part.stat().st_size
    assert CHUNK <= held < BIG_SIZE
    done = [f for f in snap.files if f is not big]
    assert all((snapshot_dir(snap, cache) / f.path).exists() for f in done)
    assert not (snapshot_dir(snap, cache) / big.path).exists()  # the partial file is not visible
    assert missing_bytes(snap, cache) == BIG_SIZE - held

    hub.throttle_bps = None
    while True:  # the server's thread writes on until it sees the dead socket
        before = dict(hub.bytes_sent_by_file)
        time.sleep(0.3)
        if before == hub.bytes_sent_by_file:
            break
    results = {f.path: fetch_file(snap, f, cache, endpoint=hub.endpoint) for f in snap.files}
    assert all(results[f.path].downloaded == 0 and hub.bytes_sent_by_file[f.path] == before[f.path] for f in done)
    assert results[big.path].resumed_from == held
    assert hub.bytes_sent_by_file[big.path] - before[big.path] == BIG_SIZE - held
    assert [r.range_start for r in hub.requests if r.path == big.path][-1] == held
    assert_complete_or_absent(snap, cache, fetch_root / REPO)
    assert missing_bytes(snap, cache) == 0


def test_unknown_repo_is_a_clear_non_retryable_error(hub):
    with pytest.raises(HubError, match="repo demo/absent not found") as info:
        resolve_snapshot("demo/absent", "main", hub.endpoint)
    assert not is_transient(info.value)


def test_unknown_revision_is_named(hub):
    with pytest.raises(HubError, match="revision 'v9' not found"):
        resolve_snapshot(REPO, "v9", hub.endpoint)


@pytest.mark.parametrize("name", ["../etc/passwd", "/abs/file", "a/../../b", "", "~/x", "a\\..\\b"])
def test_unsafe_file_names_are_rejected(name):
    with pytest.raises(HubError, match="unsafe"):
        check_filename(name)


def test_nested_file_names_are_fine():
    assert check_filename("original/config.json") == "original/config.json"


def _response(status: int):
    """A response object of whichever HTTP client this huggingface_hub is built on."""
    http = importlib.import_module(Response.__module__.split(".")[0])
    return Response(status, request=http.Request("GET", "http://127.0.0.1/x"))


@pytest.mark.parametrize("status, transient", [(500, True), (503, True), (429, True), (408, True), (401, False),
                                               (403, False), (404, False)])
def test_http_errors_retry_only_when_the_server_may_recover(status, transient):
    exc = HfHubHTTPError("x", response=_response(status))
    assert is_transient(exc) is transient
