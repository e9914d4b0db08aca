"""The deploy run's report: what a run learned, as typed results, rendered once however it ended.

The phases of `flows/deploy.py` return their results (`Served` for one new server's start, checks
and sweep); the flow builds one `DeployReport` from them at the end, and the Prefect layer publishes
its markdown as `deploy-<model>`. Nothing here imports Prefect: links to the UI come in as a function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tasks.bench.report import finding_lines, headline_table, markdown_table, png_data_uri, with_interval
from tasks.bench.results import LevelResult
from tasks.errors import failed_stage, first_line
from tasks.history.runs import RunRecord
from tasks.vllm.gap import Unavailability
from tasks.vllm.process import ServerHandle

RunLink = Callable[[str | None, str], str]  # (flow run id, text) -> a markdown link to the run's UI page


@dataclass(frozen=True)
class Served:
    """One new server's start, answer check and sweep, as far as they got. `error` is what stopped
    them (the server is stopped by then); the caller restores the last good one and raises it."""

    handle: ServerHandle | None = None  # the server, stopped when `error` is set
    facts: dict[str, str] = field(default_factory=dict)
    slow_start: str | None = None  # a start much slower than the last good one's, in words
    unavailable: Unavailability | None = None  # the gap up to this server's first answer
    results_dir: Path | None = None  # the sweep's files: chart.png, results.csv, one JSON per level
    results: list[LevelResult] = field(default_factory=list)
    stop: str | None = None  # why the sweep stopped
    record: RunRecord | None = None  # the run's history record, published
    error: BaseException | None = None
    front_url: str | None = None  # where the host's front door admitted it: the address its clients use

    @property
    def base_url(self) -> str | None:
        return self.front_url or (self.handle.base_url if self.handle else None)


@dataclass(frozen=True)
class Restored:
    """The last good deployment brought back after a failure: what serves now, or why nothing does."""

    what: str
    failed: bool
    unavailable: Unavailability | None = None  # the gap up to the restored server's first answer


@dataclass(frozen=True)
class DeployReport:
    """What a deploy run did, the one object its summary is rendered from: the verdict in its first
    line, then the figures beside the last good run's, the chart, and links to the rest."""

    repo_id: str
    revision: str
    commit: str | None = None
    serving_before: str | None = None  # "repo@commit" of what served when the run began
    previous_stopped: bool = False
    last_good: RunRecord | None = None  # the run this one is compared with
    prewarm: str | None = None  # what was read into the page cache before the old server stopped
    served: Served = field(default_factory=Served)
    restored: Restored | None = None
    keep_serving: bool = True
    error: BaseException | None = None

    @property
    def what(self) -> str:
        return f"{self.repo_id}@{(self.commit or self.revision)[:12]}"

    @property
    def base_url(self) -> str | None:
        """Where the new model serves: only when it passed and goes on serving."""
        return self.served.base_url if self.error is None and self.keep_serving else None

    @property
    def unavailable(self) -> Unavailability | None:
        """The swap's gap as the probe saw it, up to whichever server ended up answering."""
        return self.restored.unavailable if self.restored is not None else self.served.unavailable

    def verdict(self) -> str:
        """Serving, rolled back, or failed at which stage, and why: the summary's first line."""
        if self.error is None:
            return (f"Serving: {self.what} passed its checks and serves at {self.base_url}" if self.base_url else
                    f"Passed: {self.what} passed its checks, then stopped (keep_serving is off)")
        why = f"failed at {failed_stage(self.error)}: {first_line(self.error)}"
        if self.restored is not None and self.restored.failed:
            return f"Failed, and the rollback failed: {self.what} {why}. Nothing serves on this host"
        if self.restored is not None:
            return f"Rolled back: {self.what} {why}. {self.restored.what} serves again"
        if self.serving_before and not self.previous_stopped:
            return f"Failed: {self.what} {why}. {self.serving_before} keeps serving"
        return f"Failed: {self.what} {why}. Nothing serves on this host"

    def markdown(self, *, host: str, run_link: RunLink, artifact_links: list[str]) -> str:
        served, last = self.served, self.last_good
        lines = [f"# {self.verdict()}".replace("\n", " "), "", f"- **Host:** {host}"]
        lines += [f"- **{k}:** {v}" for k, v in served.facts.items()]
        if served.slow_start:
            lines.append(f"- **Slow start:** {served.slow_start}")
        if self.prewarm:
            lines.append(f"- **Before the swap:** {self.prewarm}")
        if self.unavailable is not None:
            was = last.unavailable_s if last else None
            lines.append(f"- **Unavailable during the swap:** {self.unavailable.text()}"
                         + (f" (last good deployment's swap: {was:.1f} s)" if was is not None else ""))
        if served.record is not None:
            knee = next((r for r in served.results if r.concurrency == served.record.knee_concurrency), None)
            lines += ["", *figures(served.record, last, knee.flags if knee else "", run_link=run_link), ""]
            if served.record.compared:
                lines.append(f"- **Regression gate:** {served.record.compared}")
        if served.results:
            lines += finding_lines(served.results, served.stop)
        chart = served.results_dir / "chart.png" if served.results_dir else None
        if chart is not None and chart.exists():
            lines += ["", f"![Throughput and latency against concurrency]({png_data_uri(chart.read_bytes())})"]
        if served.results:
            lines += ["", markdown_table(headline_table(served.results)), "",
                      f"± is the 95% interval. Every figure of every level, in vLLM's names: `{served.results_dir}` "
                      "(results.csv, level-*.json) on the host."]
        if artifact_links:
            lines += ["", "## This run's artifacts", "", *artifact_links]
        if last is not None and last.flow_run_id:
            lines += ["", f"Previous good run: {run_link(last.flow_run_id, last.commit[:12])}"]
        return "\n".join(lines)


def _change(now: float | None, before: float | None) -> str:
    return f"{now / before - 1:+.1%}" if now is not None and before else "-"


def figures(record: RunRecord, last: RunRecord | None, knee_flags: str, *, run_link: RunLink) -> list[str]:
    """The key figures beside the last good run's, with the change; ± is the 95% interval's half-width.
    A knee at a flagged level says so: its figure is not the server's alone."""
    def answers(r: RunRecord | None, what: str) -> float | None:
        return getattr(r.answers, what) if r and r.answers else None

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    def sig(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    rows = [("single stream, output tok/s", with_interval(record.single_stream_tok_s, record.single_stream_ci),
             with_interval(last.single_stream_tok_s, last.single_stream_ci) if last else "-",
             _change(record.single_stream_tok_s, last.single_stream_tok_s if last else None)),
            ("peak (knee), output tok/s", with_interval(record.peak_tok_s, record.peak_ci)
             + (f" at c={record.knee_concurrency}" if record.knee_concurrency else "")
             + (f" ({knee_flags})" if knee_flags else ""),
             (with_interval(last.peak_tok_s, last.peak_ci)
              + (f" at c={last.knee_concurrency}" if last.knee_concurrency else ""))
             if last else "-", _change(record.peak_tok_s, last.peak_tok_s if last else None)),
            ("p99 TTFT at the knee, ms", with_interval(record.p99_ttft_ms, record.p99_ttft_ci),
             with_interval(last.p99_ttft_ms, last.p99_ttft_ci) if last else "-",
             _change(record.p99_ttft_ms, last.p99_ttft_ms if last else None)),
            ("answer accuracy", pct(answers(record, "accuracy")), pct(answers(last, "accuracy")),
             _change(answers(record, "accuracy"), answers(last, "accuracy"))),
            ("perplexity of the reference text", sig(answers(record, "perplexity")), sig(answers(last, "perplexity")),
             _change(answers(record, "perplexity"), answers(last, "perplexity")))]
    head = run_link(last.flow_run_id, f"last good ({last.commit[:12]})") if last else "last good (none)"
    return [f"| figure | this run | {head} | change |", "|---|---|---|---|",
            *[f"| {' | '.join(row)} |" for row in rows]]
