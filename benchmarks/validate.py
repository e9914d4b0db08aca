"""Validate a Kimi-K2.5-sized checkpoint (64 sparse shards, ~594 GB apparent) from its headers.

Prints the wall time of `rollout validate` on it, beside the time safetensors' own Rust reader
takes just to open the same 64 headers and list their tensors (a floor for any header-based
check), and the bytes read as a share of the checkpoint's size.

    .venv/bin/python benchmarks/validate.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from safetensors import safe_open

from tasks.validate import validate_checkpoint

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

        ours = _best_of(lambda: validate_checkpoint(model))
        floor = _best_of(list_with_safetensors)
    print(f"checkpoint: {len(shards)} shards, {report.tensors:,} tensors, {total / 1e9:.1f} GB apparent")
    print(f"verdict: {report.verdict} ({len(report.violations)} violations, {report.modules_packed:,} packed modules)")
    print(f"rollout validate: {ours:.2f} s (median of 3)")
    print(f"safetensors open+list only: {floor:.2f} s; ratio {ours / floor:.2f}x")
    print(f"bytes read: {report.bytes_read:,} = {100 * report.bytes_read / total:.4f}% of the checkpoint")


if __name__ == "__main__":
    main()
