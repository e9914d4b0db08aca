"""History: records of real benchmark runs kept as Prefect artifacts, read back, compared."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from conftest import artifact
from prefect import flow
from prefect.runtime import flow_run
from typer.testing import CliRunner

from flows.cli import app
from flows.compare import CompareConfig, compare_runs
from tasks.answers.check import AnswerBaseline
from tasks.bench.load import run_level
from tasks.bench.spec import BenchSpec
from tasks.errors import RegressionError
from tasks.history.runs import RunRecord, check_regression, run_record
from tasks.orchestration.history import read_history
from tasks.orchestration.steps import publish_record
from testkit.openai_server import StreamingServer

pytestmark = pytest.mark.usefixtures("prefect_server")
SPEC = BenchSpec(concurrency_levels=[1, 4], requests_per_level=4, input_len=16, output_len=16)


@flow(name="benchmarked-run")
def _benchmarked_run(model: str, commit: str, ttft_s: float, itl_s: float,
                     answers: AnswerBaseline | None = None) -> RunRecord:
    """A deploy's tail end: a real sweep against a server of known speed, then its history record."""
    with StreamingServer(ttft_s=ttft_s, itl_s=itl_s) as server:
        rows = [run_level(server.base_url, "fake", SPEC, concurrency=c,
                          vocab_size=1000) for c in SPEC.concurrency_levels]
    return publish_record(run_record(rows, model, "main", commit=commit, gpu="cpu (test)", vllm_version="0.32.0",
                                     parallelism="TP=1, EP=off",
                                     flow_run_id=str(flow_run.get_id()), answers=answers))


def _record(**numbers) -> RunRecord:
    base = dict(model="org/m", revision="main", commit="a" * 40, time=datetime.now(timezone.utc), host="h", gpu="g",
                vllm_version="v", parallelism="TP=8", single_stream_tok_s=82.0, peak_tok_s=2276.0,
                knee_concurrency=64, p99_ttft_ms=900.0)
    return RunRecord(**{**base, **numbers})


def test_a_drop_beyond_the_threshold_marks_the_record_regressed():
    before = _record(time=datetime.now(timezone.utc) - timedelta(days=1))
    assert check_regression(before, _record(peak_tok_s=2100.0), 0.1).status == "passed"  # -8%
    slower = check_regression(before, _record(single_stream_tok_s=61.0, p99_ttft_ms=1200.0), 0.1)
    assert slower.status == "regressed"  # records without intervals: the threshold alone
    assert "single stream 61.0 vs 82.0 tok/s (-26%, beyond 10%, outside the noise)" in slower.note
    assert "p99 TTFT 1200.0 vs 900.0 ms (+33%" in slower.note and "peak" not in slower.note
    # Other GPUs or another model are not a baseline.
    assert check_regression(before, _record(gpu="other", peak_tok_s=1.0), 0.1).status == "passed"
    assert check_regression(before, _record(model="org/other", peak_tok_s=1.0), 0.1).status == "passed"


def test_a_drop_within_the_noise_passes_and_the_record_says_why():
    before = _record(time=datetime.now(timezone.utc) - timedelta(days=1), peak_ci=(1900.0, 2650.0))
    noisy = check_regression(before, _record(peak_tok_s=1950.0, peak_ci=(1500.0, 2400.0)), 0.1)  # -14%, overlapping
    assert noisy.status == "passed"
    assert "peak 1950.0 [1500.0, 2400.0] vs 2276.0 [1900.0, 2650.0] tok/s (-14%, beyond 10%, but within the noise)" \
        in noisy.compared
    clear = check_regression(before, _record(peak_tok_s=1500.0, peak_ci=(1450.0, 1550.0)), 0.1)
    assert clear.status == "regressed" and "(-34%, beyond 10%, outside the noise)" in clear.note
    few = check_regression(before, _record(p99_ttft_ms=None), 0.1)
    assert few.status == "passed" and "p99 TTFT not gated: too few requests" in few.compared
    moved = check_regression(before, _record(knee_concurrency=128, p99_ttft_ms=2000.0), 0.1)
    assert moved.status == "passed" and "p99 TTFT not gated: the knee moved from concurrency 64 to 128" in moved.compared


def test_history_reads_runs_of_two_models_back_and_finds_the_planted_regression():
    tag = uuid.uuid4().hex[:8]
    fast, slow = f"hist-{tag}/int4", f"hist-{tag}/nvfp4"
    for i in range(3):
        checked = AnswerBaseline(accuracy=1 - i / 32, perplexity=1.38 + i, repeated_ngrams=0.0, outputs={})
        _benchmarked_run(fast, f"{i:040d}", ttft_s=0.01, itl_s=0.002, answers=checked)
    _benchmarked_run(slow, "1" * 40, ttft_s=0.01, itl_s=0.002)
    _benchmarked_run(slow, "2" * 40, ttft_s=0.04, itl_s=0.008)  # planted: 4x slower tokens

    kept = read_history(fast)
    assert [r.commit for r in kept] == [f"{i:040d}" for i in range(3)]
    planted = read_history(slow)[-1]  # real numbers, compared with each other, not with a fixed speed
    assert all(r.single_stream_tok_s > planted.single_stream_tok_s and r.knee_concurrency in (1, 4) for r in kept)

    result = CliRunner().invoke(app, ["history", "--threshold", "0.5"])
    lines = result.stdout.splitlines()
    assert result.exit_code == 1, result.output  # the newest run of one model regressed
    assert "single stream tok/s" in lines[0] and "peak tok/s" in lines[0] and "knee" in lines[0]
    ours = [line for line in lines if f"hist-{tag}/" in line and not line.startswith("regression")]
    assert [line.split()[2] for line in ours] == [fast] * 3 + [slow] * 2
    # The answer check's figures beside the speed; runs without one say so.
    assert "accuracy" in lines[0] and "perplexity" in lines[0]
    def before_status(line: str) -> list[str]:
        words = line.split()
        at = next(i for i, w in enumerate(words) if w in ("passed", "regressed"))
        return words[at - 2:at]

    assert [before_status(line) for line in ours] == [["100%", "1.38"], ["97%", "2.38"], ["94%", "3.38"],
                                                      ["-", "-"], ["-", "-"]]
    assert f"regression: {slow} at main (2222222): single stream" in result.stdout

    one = CliRunner().invoke(app, ["history", fast, "--threshold", "0.5", "--wide"])
    assert one.exit_code == 0, one.output
    assert len(one.stdout.splitlines()) == 1 + 3 and "0.32.0" in one.stdout and slow not in one.stdout

    with pytest.raises(RegressionError, match=f"{slow}: single stream"):
        compare_runs(CompareConfig(models=[fast, slow], threshold=0.5, fail_on_regression=True))
    table = artifact("run-comparison")
    assert table.type == "table" and table.description == "5 runs of 2 model(s)"
    compared = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [(r["accuracy"], r["perplexity"]) for r in compared if r["model"] == fast] == \
        [(1.0, 1.38), (1 - 1 / 32, 2.38), (1 - 2 / 32, 3.38)]
    summary = artifact("run-comparison-summary").data
    assert summary.startswith("# Run comparison: 1 of 2 model(s) regressed in their newest run\n")
    assert f"**Regressed:** {slow} at main (2222222)" in summary
    assert "![Throughput and p99 TTFT per revision over time](data:image/png;base64,iVBOR" in summary
    assert "peak tok/s vs last good" in summary and "| single stream tok/s |" in summary.replace("  ", "")
    slow_run = read_history(slow)[-1].flow_run_id
    assert "[main (2222222)](" in summary and f"/runs/flow-run/{slow_run})" in summary  # each run links to its run


def test_history_of_an_unknown_model_says_so_and_a_bad_threshold_is_refused():
    empty = CliRunner().invoke(app, ["history", f"nobody-{uuid.uuid4().hex[:6]}/none"])
    assert empty.exit_code == 0 and "no benchmarked deployments of nobody-" in empty.stdout
    bad = CliRunner().invoke(app, ["history", "--threshold", "1.5"])
    assert bad.exit_code == 2 and "bad option --threshold 1.5" in bad.stderr


def test_a_record_stored_twice_reads_back_once():
    """A client retry after a server timeout can store one record as two artifacts."""
    record = _record(model=f"twice-{uuid.uuid4().hex[:6]}/m")
    publish_record(record)
    publish_record(record)
    assert read_history(record.model) == [record]
