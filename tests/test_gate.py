"""The regression gate against servers of fixed, known speeds: it never cries wolf on the same
server, and it always catches one made 30% slower, never one made 5% slower at a 10% threshold."""

from __future__ import annotations

import pytest

from tasks.bench.load import run_level
from tasks.bench.spec import BenchSpec
from tasks.history.runs import RunRecord, check_regression, run_record
from testkit.openai_server import StreamingServer

pytestmark = pytest.mark.quiet  # measures speed: runs alone, before the parallel part (Makefile)

SPEC = BenchSpec(concurrency_levels=[1, 4], level_duration_s=1.2, input_len=16, output_len=16)
TTFT_S, ITL_S = 0.02, 0.01


def _run(slower_by: float, repeat: int) -> RunRecord:
    """One deploy's benchmark of a server whose every delay is stretched to make it `slower_by` slower."""
    stretch = 1 / (1 - slower_by)
    with StreamingServer(ttft_s=TTFT_S * stretch, itl_s=ITL_S * stretch) as server:
        rows = [run_level(server.base_url, "fake", SPEC, concurrency=c, vocab_size=1000, repeat=repeat)
                for c in SPEC.concurrency_levels]
    return run_record(rows, "org/m", "main", commit=f"{repeat:040d}", gpu="cpu (test)", vllm_version="0",
                      parallelism="TP=1")


def test_the_gate_flags_real_slowdowns_and_nothing_else():
    baseline = _run(0.0, 0)
    last_good, same = baseline, []
    for i in range(1, 11):  # back to back, as nightlies are: each against the last passed run
        record = check_regression(last_good, _run(0.0, i), 0.1)
        same.append(record)
        last_good = record if record.status == "passed" else last_good
    assert [r.status for r in same] == ["passed"] * 10, [r.note for r in same]
    assert all(r.single_stream_ci and r.peak_ci for r in same)  # the intervals are kept with the record

    slow = [check_regression(baseline, _run(0.30, 20 + i), 0.1) for i in range(3)]
    assert [r.status for r in slow] == ["regressed"] * 3, [r.compared for r in slow]
    assert all("outside the noise" in r.note and "single stream" in r.note for r in slow)

    slight = [check_regression(baseline, _run(0.05, 30 + i), 0.1) for i in range(3)]
    assert [r.status for r in slight] == ["passed"] * 3, [r.note for r in slight]
    assert all("within 10%" in r.compared for r in slight)


def test_runs_under_another_load_are_not_compared():
    """A nightly at input 1024 after a redeploy at input 64 measures the load, not the deployment."""
    from datetime import datetime, timezone

    from tasks.history.runs import comparison

    def record(load: str | None, peak: float, at: int) -> RunRecord:
        return RunRecord(model="org/m", revision="main", commit=f"{at:040d}", time=datetime(2026, 12, 5, at,
                         tzinfo=timezone.utc), host="h", gpu="cpu", vllm_version="0", parallelism="TP=1",
                         single_stream_tok_s=peak / 10, peak_tok_s=peak, knee_concurrency=8, p99_ttft_ms=10.0,
                         load=load)

    short, long = "completions, input 64, output 32 tokens", "completions, input 1024, output 256 tokens"
    assert check_regression(record(short, 1000.0, 1), record(long, 100.0, 2), 0.1).status == "passed"
    assert check_regression(record(short, 1000.0, 1), record(short, 100.0, 2), 0.1).status == "regressed"
    assert check_regression(record(None, 1000.0, 1), record(long, 100.0, 2), 0.1).status == "regressed"
    table = comparison([record(short, 1000.0, 1), record(long, 100.0, 2), record(long, 95.0, 3)])
    assert list(table["peak_change"].fillna("-")) == ["-", "-", "-5.0%"] and list(table["regression"]) == ["", "", ""]
