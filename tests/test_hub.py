"""Fetching through the real huggingface_hub client from the local Hub look-alike."""

from __future__ import annotations

import importlib
import shutil

import pytest
from huggingface_hub.errors import HfHubHTTPError, Response

from flows.demo import BF16_REPO
from flows.demo.hub_server import LocalHub
from tasks.hub import (
    ChecksumError,
    HubError,
    check_filename,
    fetch_file,
    is_transient,
    missing_bytes,
    resolve_snapshot,
    snapshot_dir,
)


def test_fetch_pins_the_commit_and_verifies_every_file(local_hub, hub_root, tmp_path):
    snap = resolve_snapshot(BF16_REPO, "main", local_hub.endpoint)
    assert len(snap.commit) == 40
    assert {f.path for f in snap.files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    weights = next(f for f in snap.files if f.path == "model.safetensors")
    assert weights.sha256 and weights.size == (hub_root / BF16_REPO / "model.safetensors").stat().st_size

    cache = tmp_path / "hub"
    assert missing_bytes(snap, cache) == snap.total_bytes
    for f in snap.files:
        path = fetch_file(snap, f, cache, local_hub.endpoint)
        assert path.read_bytes() == (hub_root / BF16_REPO / f.path).read_bytes()
    assert snapshot_dir(snap, cache).is_dir()
    assert missing_bytes(snap, cache) == 0  # a re-run needs nothing


def test_unknown_repo_is_a_clear_non_retryable_error(local_hub):
    with pytest.raises(HubError, match="repo demo/absent not found") as info:
        resolve_snapshot("demo/absent", "main", local_hub.endpoint)
    assert not is_transient(info.value)


def test_unknown_revision_is_named(local_hub):
    with pytest.raises(HubError, match="revision 'v9' not found"):
        resolve_snapshot(BF16_REPO, "v9", local_hub.endpoint)


def test_corrupted_bytes_are_deleted_not_kept(hub_root, tmp_path):
    root = tmp_path / "hub-src"
    shutil.copytree(hub_root / BF16_REPO, root / BF16_REPO)
    with LocalHub(root) as hub:
        snap = resolve_snapshot(BF16_REPO, "main", hub.endpoint)  # hashes published now
        target = root / BF16_REPO / "model.safetensors"
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF  # same size, different bytes: what a flipped bit in transit looks like
        target.write_bytes(bytes(data))
        weights = next(f for f in snap.files if f.path == "model.safetensors")
        with pytest.raises(ChecksumError, match="does not match") as info:
            fetch_file(snap, weights, tmp_path / "cache", hub.endpoint)
    assert is_transient(info.value)
    assert not (snapshot_dir(snap, tmp_path / "cache") / "model.safetensors").exists()
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("blobs/*"))


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


@pytest.mark.parametrize("status, transient", [(500, True), (503, True), (429, True), (401, False), (403, False),
                                               (404, False)])
def test_http_errors_retry_only_when_the_server_may_recover(status, transient):
    exc = HfHubHTTPError("x", response=_response(status))
    assert is_transient(exc) is transient
