"""Our fetch against `hf download` on the same synthetic multi-shard repo, in one run.

A local hub look-alike in its own process serves a generated repo (8 shards, 3 GB by default).
Three passes over the same bytes, page cache warm for all three:
  1. raw: 8 parallel plain GETs that discard the body (the loopback + server ceiling);
  2. ours: tasks.hub.fetch_file on 8 threads (what the fetch tasks run), sha256 verified in flight;
  3. `hf download --max-workers 8` (huggingface_hub's CLI) into its own cache: size checks only;
  4. ours again, from the first pass's cache served by `rollout mirror` in its own process (what
     the hosts after a fleet's canary do), every file still held to the Hub's hash.
Each download goes to a fresh cache that is deleted afterwards.

    .venv/bin/python benchmarks/fetch.py [TOTAL_GB]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tasks.hub import fetch_file, resolve_snapshot, snapshot_dir

REPO = "bench/sharded"
SHARDS = 8
WORKERS = 8


def make_repo(root: Path, total_bytes: int) -> None:
    repo = root / REPO
    repo.mkdir(parents=True)
    (repo / "config.json").write_text('{"model_type": "bench"}')
    block = os.urandom(16 * 2**20)
    per_shard = total_bytes // SHARDS
    for i in range(SHARDS):
        with (repo / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors").open("wb") as fh:
            fh.write(i.to_bytes(8, "little"))  # shards differ, so every hash is its own
            for _ in range(per_shard // len(block)):
                fh.write(block)


def raw_read(endpoint: str, commit: str, paths: list[str]) -> float:
    def get(path: str) -> None:
        with httpx.stream("GET", f"{endpoint}/{REPO}/resolve/{commit}/{path}", timeout=None) as r:
            for _ in r.iter_raw(10 * 2**20):
                pass

    start = time.perf_counter()
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(get, paths))
    return time.perf_counter() - start


def ours(endpoint: str, cache: Path, mirror: str | None = None) -> float:
    start = time.perf_counter()
    snap = resolve_snapshot(REPO, "main", endpoint)
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda f: fetch_file(snap, f, cache, endpoint=endpoint, mirror=mirror), snap.files))
    elapsed = time.perf_counter() - start
    assert sum(r.downloaded for r in results) == snap.total_bytes
    assert all(r.source == ("mirror" if mirror else "hub") for r in results)
    assert all((snapshot_dir(snap, cache) / f.path).exists() for f in snap.files)
    return elapsed


def from_mirror(endpoint: str, tmp: Path) -> float:
    """The first pass's cache served by `rollout mirror` in its own process, fetched into a new one."""
    port = 18000 + os.getpid() % 1000
    mirror = subprocess.Popen([sys.executable, "-m", "flows.cli", "mirror", "--models-root", str(tmp / "ours"),
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/health").raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        elapsed = ours(endpoint, tmp / "mirrored" / "hub", mirror=url)
    finally:
        mirror.terminate()
        mirror.wait()
    shutil.rmtree(tmp / "mirrored")
    return elapsed


def hf_download(endpoint: str, cache: Path) -> float:
    hf = Path(sys.executable).with_name("hf")
    start = time.perf_counter()
    subprocess.run([str(hf), "download", REPO, "--cache-dir", str(cache), "--max-workers", str(WORKERS), "--quiet"],
                   check=True, env={**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    total = int(float(sys.argv[1]) * 1e9) if len(sys.argv) > 1 else 3 * 10**9
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "hub"
        make_repo(root, total)
        server = subprocess.Popen([sys.executable, "-c", "from flows.demo.hub_server import main; main()", str(root)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            endpoint = server.stdout.readline().strip()
            snap = resolve_snapshot(REPO, "main", endpoint)  # the server hashes the repo once, here
            size = snap.total_bytes
            raw_s = raw_read(endpoint, snap.commit, [f.path for f in snap.files])
            ours_s = ours(endpoint, Path(tmp) / "ours" / "hub")
            mirror_s = from_mirror(endpoint, Path(tmp))
            shutil.rmtree(Path(tmp) / "ours")
            hf_s = hf_download(endpoint, Path(tmp) / "hf")
            shutil.rmtree(Path(tmp) / "hf")
            startup = time.perf_counter()
            subprocess.run([str(Path(sys.executable).with_name("hf")), "version"], check=True,
                           stdout=subprocess.DEVNULL)
            startup_s = time.perf_counter() - startup
        finally:
            server.terminate()
            server.wait()
    mb = size / 1e6
    print(f"repo: {len(snap.files)} files, {size / 1e9:.2f} GB, {WORKERS} parallel streams, loopback")
    print(f"raw loopback read : {raw_s:6.2f} s  {mb / raw_s:7.1f} MB/s")
    print(f"ours (sha256)     : {ours_s:6.2f} s  {mb / ours_s:7.1f} MB/s  = {100 * raw_s / ours_s:.0f}% of raw")
    print(f"ours from a mirror: {mirror_s:6.2f} s  {mb / mirror_s:7.1f} MB/s  = {ours_s / mirror_s:.2f}x the Hub's "
          "rate (rollout mirror serving the first pass's cache)")
    print(f"hf download       : {hf_s:6.2f} s  {mb / hf_s:7.1f} MB/s  (of which CLI start-up ~{startup_s:.2f} s)")
    print(f"ratio ours / hf download wall time: {ours_s / hf_s:.2f} "
          f"({ours_s / max(hf_s - startup_s, 1e-9):.2f} with hf's start-up taken out)")


if __name__ == "__main__":
    main()
