"""The cache mirror: a host's verified HF cache served to the hosts after it, every byte still held
to the Hub's hash, and a mirror that fails costs that file one fetch from the Hub, no more."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import SHARDED_REPO as REPO
from test_hub import assert_complete_or_absent

from tasks.hub import fetch_file, resolve_snapshot, snapshot_dir
from tasks.mirror import CacheMirror
from testkit.faulty_mirror import FaultyMirror
from testkit.prefect_processes import wait_healthy


@pytest.fixture
def canary_cache(hub, tmp_path) -> Path:
    """The canary's cache: every file fetched from the Hub and verified."""
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    cache = tmp_path / "canary" / "hub"
    for f in snap.files:
        fetch_file(snap, f, cache, endpoint=hub.endpoint)
    return cache


def _full_gets(hub, path: str) -> int:
    return sum(r.method == "GET" and r.path == path and r.range_start == 0 for r in hub.requests)


def test_hosts_after_the_canary_read_the_mirror_and_not_the_hub(hub, fetch_root, canary_cache, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    asked = len(hub.requests)
    with FaultyMirror(canary_cache) as mirror:
        results = [fetch_file(snap, f, tmp_path / "host2" / "hub", endpoint=hub.endpoint, mirror=mirror.endpoint)
                   for f in snap.files]
    assert [r.source for r in results] == ["mirror"] * len(snap.files)
    assert all(r.mirror_error is None and r.downloaded == r.size for r in results)
    assert not [r for r in hub.requests[asked:] if "/resolve/" in r.path]  # the Hub sent no file
    assert sorted(mirror.served) == sorted(f.path for f in snap.files)
    assert_complete_or_absent(snap, tmp_path / "host2" / "hub", fetch_root / REPO)


def test_a_flipped_byte_from_the_mirror_is_caught_and_that_file_comes_from_the_hub(hub, fetch_root, canary_cache,
                                                                                   tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    shard = next(f for f in snap.files if f.path.endswith(".safetensors"))
    before = _full_gets(hub, shard.path)
    with FaultyMirror(canary_cache) as mirror:
        mirror.corrupt_once(shard.path)
        results = {f.path: fetch_file(snap, f, tmp_path / "host2" / "hub", endpoint=hub.endpoint,
                                      mirror=mirror.endpoint)
                   for f in snap.files}
    bad = results.pop(shard.path)
    assert bad.source == "hub" and "ChecksumError" in bad.mirror_error and "hashing to" in bad.mirror_error
    assert _full_gets(hub, shard.path) == before + 1  # one fetch from the Hub, for that file alone
    assert all(r.source == "mirror" for r in results.values())
    assert_complete_or_absent(snap, tmp_path / "host2" / "hub", fetch_root / REPO)


def test_a_mirror_that_is_down_or_lacks_the_commit_falls_back_to_the_hub(hub, fetch_root, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    empty = tmp_path / "empty" / "hub"
    empty.mkdir(parents=True)
    with CacheMirror(empty) as mirror:  # up, but it never fetched this commit: 404
        lacking = fetch_file(snap, snap.files[0], tmp_path / "a" / "hub", endpoint=hub.endpoint, mirror=mirror.endpoint)
    assert lacking.source == "hub" and "not found" in lacking.mirror_error
    down = fetch_file(snap, snap.files[1], tmp_path / "b" / "hub", endpoint=hub.endpoint, mirror="http://127.0.0.1:9")
    assert down.source == "hub" and "HubUnreachable" in down.mirror_error
    assert_complete_or_absent(snap, tmp_path / "a" / "hub", fetch_root / REPO)


def test_the_mirror_serves_only_verified_files_of_full_commits(hub, canary_cache, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    blobs = snapshot_dir(snap, canary_cache).parent.parent / "blobs"
    (blobs / "0123.part").write_bytes(b"partial")
    name = snap.files[0].path
    with CacheMirror(canary_cache) as mirror:
        base = f"{mirror.endpoint}/{REPO}/resolve"
        assert httpx.get(f"{base}/{snap.commit}/{name}").status_code == 200
        part = httpx.get(f"{base}/{snap.commit}/{name}", headers={"Range": "bytes=5-9"})
        assert part.status_code == 206 and part.content == (snapshot_dir(snap, canary_cache) / name).read_bytes()[5:10]
        for path in (f"main/{name}",  # a branch: the mirror never decides which commit a host deploys
                     f"{snap.commit}/../../blobs/0123.part", f"{snap.commit}/%2e%2e/%2e%2e/blobs/0123.part",
                     f"{snap.commit}/missing.json"):
            assert httpx.get(f"{base}/{path}").status_code == 404, path


def test_rollout_mirror_serves_a_models_root_until_stopped(hub, canary_cache, tmp_path):
    snap = resolve_snapshot(REPO, "main", hub.endpoint)
    bad = subprocess.run([sys.executable, "-m", "flows.cli", "mirror", "--models-root", str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"error: --models-root {tmp_path / 'nothing'}: no such folder"]
    port = 18000 + int(time.time()) % 1000
    served = subprocess.Popen([sys.executable, "-m", "flows.cli", "mirror", "--models-root", str(canary_cache.parent),
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(served, f"http://127.0.0.1:{port}")
        result = fetch_file(snap, snap.files[0], tmp_path / "host2" / "hub", endpoint=hub.endpoint,
                            mirror=f"http://127.0.0.1:{port}")
        assert result.source == "mirror"
    finally:
        served.terminate()
        out, err = served.communicate(timeout=30)
    assert served.returncode in (0, 143) and "Traceback" not in err
    assert f"GET {REPO} {snap.files[0].path} bytes 0-" in out  # its log: what it served, to whom it is asked
