"""One record per benchmarked deployment, kept as a Prefect artifact and read back to compare runs.

Each deploy publishes a one-row table artifact `history-<model>`; Prefect keeps every version of a
key, so the artifacts of all runs are the history ("INT4 82 tok/s single stream vs NVFP4 61").
Reading goes through the Prefect client, page by page, so it works against any server the flows
report to, and what an engineer sees in the UI is what `rollout history` prints.
"""

from __future__ import annotations

import socket
from datetime import datetime, timezone

import pandas as pd
from pydantic import BaseModel

from tasks.bench.results import LevelResult
from tasks.bench.sweep import knee

# Columns of the comparison table, in print order.
COLUMNS = ["time", "model", "revision", "single_stream_tok_s", "peak_tok_s", "knee_concurrency", "p99_ttft_ms",
           "vllm_version", "gpu", "status", "change", "regression"]


class RunRecord(BaseModel):
    """What a run is compared by; `status` is passed or regressed, `note` says against what."""

    model: str
    revision: str
    commit: str
    time: datetime
    host: str
    gpu: str
    vllm_version: str
    parallelism: str
    single_stream_tok_s: float | None
    peak_tok_s: float | None
    knee_concurrency: int | None
    p99_ttft_ms: float | None
    status: str = "passed"
    note: str = ""
    compared: str = ""  # the change against the previous good run of the same model on the same GPUs
    flow_run_id: str | None = None


def run_record(results: list[LevelResult], model: str, revision: str, commit: str, gpu: str, vllm_version: str,
               parallelism: str, flow_run_id: str | None = None) -> RunRecord:
    """Single stream, the knee's throughput and its p99 TTFT, from one sweep's rows."""
    best = knee(results)
    single = next((r for r in results if r.concurrency == 1), None)
    return RunRecord(
        model=model, revision=revision, commit=commit, time=datetime.now(timezone.utc), host=socket.gethostname(),
        gpu=gpu, vllm_version=vllm_version, parallelism=parallelism,
        single_stream_tok_s=single.output_throughput if single else None,
        peak_tok_s=best.output_throughput if best else None,
        knee_concurrency=best.concurrency if best else None,
        p99_ttft_ms=best.ttft.p99 if best else None,
        flow_run_id=flow_run_id,
    )


def regressions(previous: RunRecord, current: RunRecord, threshold: float) -> list[str]:
    """Each number more than `threshold` (a fraction) worse than the previous good run's."""
    found = []
    for field, label in (("single_stream_tok_s", "single-stream tok/s"), ("peak_tok_s", "peak tok/s")):
        before, now = getattr(previous, field), getattr(current, field)
        if before and now is not None and now < before * (1 - threshold):
            found.append(f"{label} {now:.1f} vs {before:.1f} ({now / before - 1:+.0%})")
    before, now = previous.p99_ttft_ms, current.p99_ttft_ms
    if before and now is not None and now > before * (1 + threshold):
        found.append(f"p99 TTFT {now:.1f} ms vs {before:.1f} ms ({now / before - 1:+.0%})")
    return found


def changes(previous: RunRecord, current: RunRecord) -> str:
    """Every compared number beside its predecessor, gated or not: what a reader of the run wants first."""
    parts = []
    for field, label, unit in (("single_stream_tok_s", "single stream", "tok/s"), ("peak_tok_s", "peak", "tok/s"),
                               ("p99_ttft_ms", "p99 TTFT", "ms")):
        before, now = getattr(previous, field), getattr(current, field)
        if before and now is not None:
            parts.append(f"{label} {now:.1f} vs {before:.1f} {unit} ({now / before - 1:+.0%})")
    return f"against {previous.commit[:12]} ({previous.time:%Y-%m-%d %H:%M}): " + ", ".join(parts)


def check_regression(previous: RunRecord | None, current: RunRecord, threshold: float | None) -> RunRecord:
    """The record with its comparison against `previous`, marked regressed (with what) when a number
    is worse beyond `threshold`; with no threshold it is compared, never marked."""
    if previous is None or previous.model != current.model or previous.gpu != current.gpu:
        return current
    current = current.model_copy(update={"compared": changes(previous, current)})
    found = regressions(previous, current, threshold) if threshold is not None else []
    if not found:
        return current
    note = f"regressed beyond {threshold:.0%} against {previous.commit[:12]} ({previous.time:%Y-%m-%d %H:%M}): " \
           + "; ".join(found)
    return current.model_copy(update={"status": "regressed", "note": note})


def comparison(records: list[RunRecord], threshold: float | None = 0.1) -> pd.DataFrame:
    """One row per run, oldest first. `change` is peak throughput against the same model's previous
    passed run on the same GPUs; `regression` lists what fell beyond the threshold against it."""
    rows, last_passed = [], {}
    for record in sorted(records, key=lambda r: r.time):
        before = last_passed.get((record.model, record.gpu))
        change, found = "", []
        if before is not None:
            if before.peak_tok_s and record.peak_tok_s is not None:
                change = f"{record.peak_tok_s / before.peak_tok_s - 1:+.1%}"
            found = regressions(before, record, threshold) if threshold is not None else []
        if record.status == "passed" and not found:
            last_passed[(record.model, record.gpu)] = record
        revision = record.commit[:12] if record.revision == record.commit else f"{record.revision} ({record.commit[:7]})"
        rows.append({**record.model_dump(), "time": f"{record.time:%Y-%m-%d %H:%M:%S}", "revision": revision,
                     "change": change, "regression": "; ".join(found)})
    return pd.DataFrame(rows, columns=COLUMNS)
