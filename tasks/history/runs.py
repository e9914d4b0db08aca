"""One record per benchmarked deployment, kept as a Prefect artifact and read back to compare runs.

Each deploy publishes a one-row table artifact `history-<model>`; Prefect keeps every version of a
key, so the artifacts of all runs are the history ("INT4 82 tok/s single stream vs NVFP4 61").
Reading goes through the Prefect client, page by page, so it works against any server the flows
report to, and what an engineer sees in the UI is what `rollout history` prints.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pandas as pd
from pydantic import BaseModel

from tasks.answers.check import AnswerBaseline
from tasks.bench.results import LevelResult
from tasks.bench.sweep import knee, single_stream
from tasks.host import host_name

# Columns of the comparison table, in print order.
COLUMNS = ["time", "model", "revision", "single_stream_tok_s", "peak_tok_s", "knee_concurrency", "p99_ttft_ms",
           "accuracy", "perplexity", "vllm_version", "gpu", "status", "peak_change", "regression", "flow_run_id",
           "host", "load", "unavailable_s"]
# The same columns as a person reads them: units in the headers, values rounded to what they resolve.
READABLE = {"time": "time (UTC)", "model": "model", "revision": "revision",
            "single_stream_tok_s": "single stream tok/s",
            "peak_tok_s": "peak tok/s", "knee_concurrency": "knee", "p99_ttft_ms": "p99 TTFT ms",
            "accuracy": "accuracy", "perplexity": "perplexity", "status": "status", "unavailable_s": "down s",
            "peak_change": "peak tok/s vs last good", "vllm_version": "vLLM", "gpu": "GPUs", "host": "host",
            "load": "load"}


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
    p99_ttft_ms: float | None  # None where the knee had too few requests for a p99
    # 95% intervals of the three: the gate's noise test. None in records from before they were kept.
    single_stream_ci: tuple[float, float] | None = None
    peak_ci: tuple[float, float] | None = None
    p99_ttft_ci: tuple[float, float] | None = None
    answers: AnswerBaseline | None = None  # the answer check's figures and outputs: the next check's baseline
    load: str | None = None  # the benchmark's load in words (BenchSpec.load); None in records from before it was kept
    unavailable_s: float | None = None  # the swap's gap as a client saw it (tasks/vllm/gap.py); None: nothing served
    startup: dict[str, float] | None = None  # the start's phases in seconds (ServerFacts.phases): the next start's
    # yardstick
    status: str = "passed"
    note: str = ""
    compared: str = ""  # the change against the previous good run of the same model on the same GPUs
    flow_run_id: str | None = None


def run_record(results: list[LevelResult], model: str, revision: str, *, commit: str, gpu: str, vllm_version: str,
               parallelism: str, flow_run_id: str | None = None, answers: AnswerBaseline | None = None,
               load: str | None = None, unavailable_s: float | None = None,
               startup: dict[str, float] | None = None) -> RunRecord:
    """Single stream, the knee's throughput and its p99 TTFT, from one sweep's rows."""
    best = knee(results)
    single = single_stream(results)
    return RunRecord(
        model=model, revision=revision, commit=commit, time=datetime.now(timezone.utc), host=host_name(),
        gpu=gpu, vllm_version=vllm_version, parallelism=parallelism,
        single_stream_tok_s=single.output_throughput if single else None,
        peak_tok_s=best.output_throughput if best else None,
        knee_concurrency=best.concurrency if best else None,
        p99_ttft_ms=best.ttft.p99 if best else None,
        single_stream_ci=single.output_throughput_ci if single else None,
        peak_ci=best.output_throughput_ci if best else None,
        p99_ttft_ci=best.ttft.p99_ci if best else None,
        flow_run_id=flow_run_id,
        answers=answers,
        load=load,
        unavailable_s=unavailable_s,
        startup=startup,
    )


# (value field, interval field, label, unit, whether more is better)
_GATED = (("single_stream_tok_s", "single_stream_ci", "single stream", "tok/s", True),
          ("peak_tok_s", "peak_ci", "peak", "tok/s", True),
          ("p99_ttft_ms", "p99_ttft_ci", "p99 TTFT", "ms", False))


def _figure(value: float, ci: tuple[float, float] | None, unit: str) -> str:
    return f"{value:.1f} [{ci[0]:.1f}, {ci[1]:.1f}] {unit}" if ci else f"{value:.1f} {unit}"


def assess(previous: RunRecord, current: RunRecord, threshold: float | None) -> list[tuple[str, bool]]:
    """Each figure against the previous good run's, in words, and whether it regressed: worse by more
    than `threshold` (the practical bar) and outside the noise (the two 95% intervals do not
    overlap). Records without intervals are judged by the threshold alone."""
    found = []
    for field, ci_field, label, unit, more_is_better in _GATED:
        before, now = getattr(previous, field), getattr(current, field)
        if before and now is None:
            found.append((f"{label} not gated: too few requests in this run to measure it", False))
        if not before or now is None:
            continue
        if field == "p99_ttft_ms" and previous.knee_concurrency != current.knee_concurrency:
            # TTFT grows with concurrency: at another knee it measures the load, not the model.
            found.append((f"{label} not gated: the knee moved from concurrency {previous.knee_concurrency} to "
                          f"{current.knee_concurrency}", False))
            continue
        was, ci = getattr(previous, ci_field), getattr(current, ci_field)
        change = now / before - 1
        worse_by = -change if more_is_better else change
        beyond = threshold is not None and worse_by > threshold
        apart = was is None or ci is None or (ci[1] < was[0] if more_is_better else ci[0] > was[1])
        if not beyond:
            why = f"within {threshold:.0%}" if threshold is not None else "not gated"
        else:
            why = "beyond {:.0%}, ".format(threshold) + ("outside the noise" if apart else "but within the noise")
        found.append((f"{label} {_figure(now, ci, '')}vs {_figure(before, was, unit)} ({change:+.0%}, {why})",
                      beyond and apart))
    return found


def check_regression(previous: RunRecord | None, current: RunRecord, threshold: float | None) -> RunRecord:
    """The record with why it passed or regressed against `previous` (each figure with its interval),
    marked regressed where a figure is worse beyond `threshold` and outside the noise; with no
    threshold it is compared, never marked."""
    if previous is None or not comparable_runs(previous, current):
        return current
    found = assess(previous, current, threshold)
    against = f"against {previous.commit[:12]} ({previous.time:%Y-%m-%d %H:%M}): "
    current = current.model_copy(update={"compared": against + "; ".join(text for text, _ in found)})
    regressed = [text for text, bad in found if bad]
    if not regressed:
        return current
    return current.model_copy(update={"status": "regressed", "note": "regressed " + against + "; ".join(regressed)})


def comparable_runs(before: RunRecord, now: RunRecord) -> bool:
    """The same model on the same GPUs under the same load: a sweep at other lengths or levels
    measures the load, not the deployment. A record from before loads were kept compares with any."""
    return (before.model, before.gpu) == (now.model, now.gpu) and (
        not before.load or not now.load or before.load == now.load)


def newest_regressed(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of `comparison`'s table that are a model's newest run and regressed: what `rollout
    history` exits 1 on, the compare flow fails on, and its summary names."""
    newest = table.groupby("model").tail(1)
    return newest[newest["regression"] != ""]


def comparison(records: list[RunRecord], threshold: float | None = 0.1) -> pd.DataFrame:
    """One row per run, oldest first. `peak_change` is peak throughput against the same model's
    previous passed run on the same GPUs; `regression` lists what fell beyond the threshold against it."""
    rows, passed = [], []
    for record in sorted(records, key=lambda r: r.time):
        before = next((r for r in reversed(passed) if comparable_runs(r, record)), None)
        change, found = None, []
        if before is not None:
            if before.peak_tok_s and record.peak_tok_s is not None:
                change = f"{record.peak_tok_s / before.peak_tok_s - 1:+.1%}"
            found = [text for text, bad in assess(before, record, threshold) if bad]
        if record.status == "passed" and not found:
            passed.append(record)
        revision = record.commit[:12] if record.revision == record.commit else f"{record.revision} ({record.commit[:7]})"
        answers = record.answers
        rows.append({**record.model_dump(), "time": f"{record.time:%Y-%m-%d %H:%M:%S}", "revision": revision,
                     "accuracy": answers.accuracy if answers else None,
                     "perplexity": answers.perplexity if answers else None,
                     "peak_change": change, "regression": "; ".join(found)})
    return pd.DataFrame(rows, columns=COLUMNS)


def readable(table: pd.DataFrame, wide: bool = False) -> pd.DataFrame:
    """The comparison as a person reads it (the CLI's and the UI's table): rounded, with units in the
    headers; the vLLM version and GPUs only when `wide`, and no column that is empty on every row."""
    def number(column: str) -> pd.Series:
        return pd.to_numeric(table[column], errors="coerce")

    shown = table.assign(
        single_stream_tok_s=number("single_stream_tok_s").round(1), peak_tok_s=number("peak_tok_s").round(1),
        p99_ttft_ms=number("p99_ttft_ms").round(1), perplexity=number("perplexity").map(_sig3),
        accuracy=number("accuracy").map(lambda a: f"{a:.0%}" if pd.notna(a) else None),
        knee_concurrency=number("knee_concurrency").astype("Int64"), unavailable_s=number("unavailable_s").round(1))
    columns = [c for c in READABLE if wide or c not in ("vllm_version", "gpu", "host", "load")]
    return shown[columns].rename(columns=READABLE).dropna(axis="columns", how="all")


def _sig3(value) -> str | None:
    return f"{value:.3g}" if pd.notna(value) else None
