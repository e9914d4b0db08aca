"""Validate a Kimi-K2.5-sized checkpoint (64 sparse shards, ~594 GB apparent) from its headers.

The checkpoint has the real Kimi-K2.5 layout: text weights nested under `language_model.`, int32
weight_shape values, a vision tower stored unquantized without an ignore entry. Prints the wall
time of the `rollout validate` command on it (a fresh process: imports included, as a user waits
for it), the in-process time of the check alone, the time safetensors' own Rust reader takes just
to open the same 64 headers and list their tensors (a floor for any header-based check), and the
bytes read as a share of the checkpoint's size.

    .venv/bin/python benchmarks/validate.py
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

from tasks.checkpoint.rules import validate_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testkit: not installed

from testkit.sparse import write_sparse_kimi  # noqa: E402


def _best_of(fn, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "kimi-k2.5-int4"
        total = write_sparse_kimi(model)
        shards = sorted(model.glob("*.safetensors"))
        report = validate_checkpoint(model)

        def list_with_safetensors() -> None:
            for shard in shards:
                with safe_open(shard, framework="numpy") as f:
                    for name in f.keys():
                        f.get_slice(name).get_shape()

        rollout = shutil.which("rollout", path=str(Path(sys.executable).parent)) or "rollout"
        cli = _best_of(lambda: subprocess.run([rollout, "validate", str(model)], check=True, capture_output=True))
        ours = _best_of(lambda: validate_checkpoint(model))
        floor = _best_of(list_with_safetensors)
    print(f"checkpoint: {len(shards)} shards, {report.tensors:,} tensors, {total / 1e9:.1f} GB apparent")
    print(f"verdict: {report.verdict} ({len(report.violations)} violations, {report.modules_packed:,} packed modules)")
    print(f"`rollout validate DIR` wall time: {cli:.2f} s (median of 3, a new process each)")
    print(f"validate_checkpoint in process: {ours:.2f} s (median of 3)")
    print(f"safetensors open+list only: {floor:.2f} s; ratio {ours / floor:.2f}x")
    print(f"bytes read: {report.bytes_read:,} = {100 * report.bytes_read / total:.4f}% of the checkpoint")


if __name__ == "__main__":
    main()
