"""The deploy run's one report (tasks/deployment/summary.py), rendered without Prefect: the verdict
line for every way a run ends, and the figures beside the last good run's."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from tasks.deployment.summary import DeployReport, Restored, Served
from tasks.errors import AnswerCheckFailed
from tasks.history.runs import RunRecord
from tasks.vllm.gap import Unavailability
from tasks.vllm.process import ServerHandle

NOW = datetime(2026, 12, 5, 3, 0, tzinfo=timezone.utc)
HANDLE = ServerHandle(pid=1, pgid=1, base_url="http://127.0.0.1:8000/v1", log_path=Path("vllm.log"),
                      state_file=Path("server.json"), command=["vllm"])
WRONG = AnswerCheckFailed("demo/m@new: accuracy 12% below 80%")


def _record(peak: float, commit: str, unavailable_s: float | None = None) -> RunRecord:
    return RunRecord(model="demo/m", revision="main", commit=commit, time=NOW, host="h", gpu="cpu", vllm_version="0",
                     parallelism="tp1", single_stream_tok_s=100.0, peak_tok_s=peak, knee_concurrency=8,
                     p99_ttft_ms=20.0, unavailable_s=unavailable_s, flow_run_id="run-1")


def _gap(seconds: float) -> Unavailability:
    return Unavailability(seconds=seconds, last_old_answer=NOW, first_new_answer=NOW, probes=40, failed=36,
                          interval_s=0.5)




@pytest.mark.parametrize("report, verdict", [
    (DeployReport("demo/m", "main", commit="c" * 40, served=Served(handle=HANDLE)),
     f"Serving: demo/m@{'c' * 12} passed its checks and serves at http://127.0.0.1:8000/v1"),
    (DeployReport("demo/m", "main", commit="c" * 40, served=Served(handle=HANDLE), keep_serving=False),
     f"Passed: demo/m@{'c' * 12} passed its checks, then stopped (keep_serving is off)"),
    (DeployReport("demo/m", "main", serving_before="demo/m@" + "a" * 12, error=WRONG),
     f"Failed: demo/m@main failed at the answer check: AnswerCheckFailed: {WRONG}. demo/m@{'a' * 12} keeps serving"),
    (DeployReport("demo/m", "main", commit="c" * 40, serving_before="demo/m@a", previous_stopped=True,
                  served=Served(handle=HANDLE), restored=Restored(what="demo/m@a at http://x/v1", failed=False),
                  error=WRONG),
     f"Rolled back: demo/m@{'c' * 12} failed at the answer check: AnswerCheckFailed: {WRONG}. demo/m@a at http://x/v1 serves again"),
    (DeployReport("demo/m", "main", commit="c" * 40, previous_stopped=True,
                  restored=Restored(what="out of memory", failed=True), error=WRONG),
     f"Failed, and the rollback failed: demo/m@{'c' * 12} failed at the answer check: AnswerCheckFailed: {WRONG}. "
     "Nothing serves on this host"),
    (DeployReport("demo/m", "main", error=KeyboardInterrupt()),
     "Failed: demo/m@main failed at an interruption (SIGTERM, Ctrl-C or a cancel): KeyboardInterrupt: . "
     "Nothing serves on this host"),
])
def test_the_verdict_says_how_the_run_ended_and_what_serves(report, verdict):
    assert report.verdict() == verdict
    assert report.markdown(host="h", run_link=lambda _, text: text, artifact_links=[]).startswith(f"# {verdict}\n")
    if report.error is not None:
        assert report.base_url is None  # a failed run serves nowhere, whatever its server did before it failed


def test_the_summary_shows_the_gap_of_whichever_server_answered_and_the_figures_beside_the_last_good():
    last = _record(1000.0, "a" * 40, unavailable_s=12.5)
    served = Served(handle=HANDLE, unavailable=_gap(20.0), record=_record(900.0, "c" * 40))
    ok = DeployReport("demo/m", "main", commit="c" * 40, last_good=last, served=served)
    text = ok.markdown(host="gpu-7", run_link=lambda run, t: f"[{t}](/runs/{run})", artifact_links=["- [x](/a)"])
    assert "- **Host:** gpu-7" in text
    assert "- **Unavailable during the swap:** 20.0 s without an answer (36 of 40 probes every 0.5 s failed) " \
           "(last good deployment's swap: 12.5 s)" in text
    assert f"| figure | this run | [last good ({'a' * 12})](/runs/run-1) | change |" in text
    assert "| peak (knee), output tok/s | 900.0 at c=8 | 1,000.0 at c=8 | -10.0% |" in text
    assert "## This run's artifacts\n\n- [x](/a)" in text
    # Rolled back: the gap runs to the restored server's first answer, not the failed one's.
    back = DeployReport("demo/m", "main", commit="c" * 40, last_good=last, served=served, error=WRONG,
                        restored=Restored(what="demo/m@a", failed=False, unavailable=_gap(55.0)))
    assert back.unavailable.seconds == 55.0
    assert "**Unavailable during the swap:** 55.0 s" in back.markdown(host="h", run_link=lambda _, t: t,
                                                                      artifact_links=[])
