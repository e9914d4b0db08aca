"""Every Prefect artifact the flows publish: one home for the keys, so what the UI shows is written
once. The stages render their own markdown (tasks/deployment/summary.py, tasks/answers/report.py,
tasks/tuning/report.py); the history is read back in tasks/orchestration/history.py.

Keys are `<what>-<model slug>` (Prefect allows lowercase letters, digits and dashes only) and
Prefect keeps every version of a key, so a model's runs line up under the same keys in the UI.
"""

from __future__ import annotations

import math
import shlex
import threading
import time
from pathlib import Path

import pandas as pd
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.answers.check import AnswerReport
from tasks.answers.files import FilesComparison
from tasks.answers.report import answers_markdown, files_markdown
from tasks.bench.report import headline_table, png_data_uri
from tasks.bench.report import markdown_table as _markdown_table
from tasks.bench.results import LevelResult
from tasks.checkpoint.rules import ValidationReport
from tasks.deployment.summary import DeployReport
from tasks.disk import GB, DiskPlan, EvictionResult, plan_summary
from tasks.errors import ServerStartError
from tasks.findings import Violation
from tasks.fleet.rollout import FleetReport
from tasks.gpu import GpuProbe, HardwarePlan
from tasks.history.chart import history_chart
from tasks.history.runs import RunRecord, newest_regressed, readable
from tasks.host import host_name
from tasks.hub import FetchResult
from tasks.names import model_slug
from tasks.orchestration.history import HISTORY, PAGE
from tasks.tuning.measure import CandidateResult
from tasks.tuning.report import tuning_markdown, tuning_rows
from tasks.vllm.readiness import PHASES, ServerFacts, slow_start


def ui_link(path: str) -> str:
    """A page of the Prefect UI the run reports to (PREFECT_UI_URL); relative where none is known."""
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/')}/{path}" if base else f"/{path}"


def run_link(flow_run_id: str | None, text: str) -> str:
    return f"[{text}]({ui_link(f'runs/flow-run/{flow_run_id}')})" if flow_run_id else text


def json_value(value):
    """Artifacts are JSON: numpy scalars and NaN are not."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


# Disk
def publish_disk_plan(plan: DiskPlan, repo_id: str, dry_run: bool) -> None:
    """The plan as a table and a markdown verdict, so a UI redeploy shows what it would delete."""
    key = f"disk-plan-{model_slug(repo_id)}"
    create_table_artifact(key=f"{key}-table", table=[
        {"model": e.model.name, "kind": e.model.kind, "GB": round(e.model.bytes / GB, 3), "action": e.action,
         "reason": e.reason, "last_used": round(e.model.last_used)} for e in plan.entries
    ], description=f"disk plan: {len(plan.evictions)} to evict")
    lines = ["# Disk plan", "", f"- Filesystem {plan.filesystem}: {plan.free_bytes / GB:.2f} GB free of "
             f"{plan.total_bytes / GB:.2f} GB (statvfs)",
             f"- New model needs {plan.needed_bytes / GB:.2f} GB + {plan.margin_bytes / GB:.2f} GB margin",
             f"- Shortfall {plan.shortfall_bytes / GB:.2f} GB; evictions free {plan.freed_bytes / GB:.2f} GB",
             f"- Verdict: {'fits' if plan.fits else 'DOES NOT FIT'}"
             + (" (dry run: nothing is deleted)" if dry_run and plan.evictions else "")]
    lines += ["", "## Warnings", ""] + [f"- **{w}**" for w in plan.warnings] if plan.warnings else []
    create_markdown_artifact(key=key, markdown="\n".join(lines), description=plan_summary(plan))


def publish_eviction(result: EvictionResult, repo_id: str) -> None:
    create_markdown_artifact(key=f"disk-after-{model_slug(repo_id)}", markdown="\n".join([
        "# Disk after eviction", "",
        f"- Deleted: {', '.join(result.deleted) or 'nothing'}",
        f"- Free before {result.free_before_bytes / GB:.2f} GB, after {result.free_after_bytes / GB:.2f} GB (statvfs)",
        f"- Freed: measured {result.measured_freed_bytes / GB:.2f} GB, planned {result.expected_freed_bytes / GB:.2f} GB",
    ]), description="measured free space before and after deleting")


# Fetch
class FetchProgress:
    """Bytes done over the whole model as one Prefect progress artifact, fed by every fetch thread.

    Updates are throttled (one API call a second at most): 64 shards streaming 10 MB chunks would
    otherwise spend more time telling the server than downloading.
    """

    def __init__(self, total_bytes: int, done_bytes: int, repo_id: str, every_s: float = 1.0):
        self.total = max(total_bytes, 1)
        self.done = done_bytes
        self._every = every_s
        self._last = 0.0
        self._lock = threading.Lock()
        self.artifact_id = create_progress_artifact(progress=self.percent, key=f"fetch-progress-{model_slug(repo_id)}",
                                                    description=f"bytes fetched of {total_bytes:,}")

    @property
    def percent(self) -> float:
        return round(100.0 * self.done / self.total, 2)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < self._every:
                return
            self._last = now
        update_progress_artifact(self.artifact_id, self.percent)

    def finish(self) -> None:
        update_progress_artifact(self.artifact_id, self.percent)


def publish_fetch(results: list[FetchResult], wall_s: float, repo_id: str) -> None:
    """Per-file and overall MB/s and where each file came from, so a slow link, a slow shard or a
    mirror that failed its hash shows in the run's history."""
    downloaded = sum(r.downloaded for r in results)
    rows = [{"file": r.path, "MB": round(r.size / 1e6, 3), "downloaded_MB": round(r.downloaded / 1e6, 3),
             "resumed_from_MB": round(r.resumed_from / 1e6, 3), "seconds": round(r.seconds, 3),
             "MB_per_s": round(r.mb_per_s, 1), "source": r.source, "mirror_error": r.mirror_error or ""}
            for r in results]
    by_source = {s: sum(r.source == s for r in results) for s in ("hub", "mirror", "cache")}
    failures = sum(r.mirror_error is not None for r in results)
    rows.append({"file": "(all, wall clock)", "MB": round(sum(r.size for r in results) / 1e6, 3),
                 "downloaded_MB": round(downloaded / 1e6, 3),
                 "resumed_from_MB": round(sum(r.resumed_from for r in results) / 1e6, 3),
                 "seconds": round(wall_s, 3), "MB_per_s": round(downloaded / 1e6 / wall_s, 1) if wall_s > 0 else 0.0,
                 "source": ", ".join(f"{n} {s}" for s, n in by_source.items() if n),
                 "mirror_error": f"{failures} mirror failure(s)" if failures else ""})
    create_table_artifact(key=f"fetch-{model_slug(repo_id)}", table=rows,
                          description=f"{downloaded / 1e6:,.1f} MB downloaded in {wall_s:.1f} s")


# Validation
def publish_validation(report: ValidationReport, repo_id: str, stage: str) -> None:
    """The verdict in markdown, and the per-role table (count, dtype, bytes) with the violations."""
    slug = model_slug(repo_id)
    lines = [f"# Checkpoint validation of {repo_id} ({stage})", "", f"**Verdict:** {report.verdict}", ""]
    lines += [f"- {n}" for n in report.notes]
    for label, items in (("Violations", report.violations), ("Warnings", report.warnings)):
        if items:
            lines += ["", f"## {label}", ""] + [f"- `{v.rule}` {v.module}: {v.message}" for v in items]
    lines += ["", f"{report.files} file(s), {report.tensors} tensors, {report.modules_packed} packed modules; "
              f"read {report.bytes_read:,} of {report.total_bytes:,} bytes"]
    create_markdown_artifact(key=f"validation-{stage}-{slug}", markdown="\n".join(lines),
                             description=f"compressed-tensors layout check {stage}: {report.verdict}")
    rows = [dict(row, rule="", message="") for row in report.summary]
    rows += [{"role": "violation", "storage": "", "dtype": "", "modules": 1, "bytes": 0, "rule": v.rule,
              "message": f"{v.module}: {v.message}"} for v in report.violations]
    create_table_artifact(key=f"validation-table-{stage}-{slug}", table=rows,
                          description=f"{report.source}: {report.verdict}")


# GPUs and vLLM
def publish_hardware(gpu: GpuProbe, plan: HardwarePlan, findings: list[Violation], *, passed: bool,
                     repo_id: str) -> None:
    gpus = ", ".join(f"{g.name} (cc {g.compute_capability[0]}.{g.compute_capability[1]}, "
                     f"{g.memory_total_bytes / 1e9:.0f} GB)" for g in gpu.gpus) or f"none ({gpu.reason})"
    lines = [f"# Hardware check: {'pass' if passed else 'fail'}", "", f"- **GPUs:** {gpus}",
             f"- **Interconnect:** {gpu.interconnect}", f"- **Driver:** {gpu.driver}",
             f"- **Plan:** TP={plan.tensor_parallel_size}, {plan.weights_bytes / 1e9:.1f} GB weights, "
             f"FP8 KV {'yes' if plan.kv_cache_fp8 else 'no'}, gpu_memory_utilization {plan.gpu_memory_utilization}"]
    lines += [f"- `{v.rule}` {v.message}" for v in findings]
    create_markdown_artifact(key=f"hardware-{model_slug(repo_id)}", markdown="\n".join(lines),
                             description="GPU and config check")


def publish_server_failure(err: ServerStartError, repo_id: str, suffix: str = "") -> None:
    """The cause, what to try next (before the log, so nobody has to read the log to know it) and the tail."""
    step = f"**Next step:** {err.next_step}\n\n" if getattr(err, "next_step", "") else ""
    create_markdown_artifact(
        key=f"server-failure-{model_slug(repo_id)}{suffix}",
        markdown=f"# vLLM failed to start\n\n**Cause:** `{err.cause}`\n\n{step}{err}\n\n```\n{err.log_tail}\n```\n",
        description=f"vLLM start-up failure: {err.cause}",
    )


def command_block(command: list[str]) -> str:
    """The command as a shell would take it, one option per line, so the UI shows it unclipped."""
    lines, current = [], []
    for arg in command:
        if arg.startswith("-") and current:
            lines.append(" ".join(current))
            current = []
        current.append(shlex.quote(arg))
    lines.append(" ".join(current))
    return "```bash\n" + " \\\n  ".join(lines) + "\n```"


def publish_server(facts: ServerFacts, command: list[str], repo_id: str, *,
                   last_good: dict[str, float] | None = None) -> None:
    """The serving facts a run is compared by later: version, KV cache, the start's phases beside the
    last good start's, and the command."""
    kv = [f"- **KV cache:** {facts.kv_cache_tokens:,} tokens" if facts.kv_cache_tokens is not None else "",
          f"- **KV cache capacity:** {facts.kv_cache_requests:g} requests of max_model_len tokens (vLLM's "
          "\"maximum concurrency\")" if facts.kv_cache_requests is not None else "",
          f"- **Memory left for the KV cache:** {facts.kv_cache_memory_gib:g} GiB"
          if facts.kv_cache_memory_gib is not None else ""]
    rows = ["| phase | this start, s | last good start, s |", "|---|---|---|"]
    rows += [f"| {PHASES[k]} | {v:.1f} | {last_good[k]:.1f} |" if last_good and k in last_good else
             f"| {PHASES[k]} | {v:.1f} | - |" for k, v in facts.phases.items()]
    slow = slow_start(facts.phases, last_good)
    lines = ["# vLLM server", "", f"- **vLLM version:** {facts.vllm_version}",
             f"- **ready after (s):** {facts.startup_s:.1f}", *[line for line in kv if line],
             *([f"- **Slow start:** {slow}"] if slow else []), "", *rows, "", command_block(command)]
    create_markdown_artifact(key=f"server-{model_slug(repo_id)}", markdown="\n".join(lines),
                             description=f"vLLM {facts.vllm_version} ready in {facts.startup_s:.0f} s")


def publish_rollback(repo_id: str, restored: str, why: str, *, outcome: str) -> None:
    """Why the last good deployment was started again, and what serves now (or that nothing does)."""
    create_markdown_artifact(key=f"rollback-{model_slug(repo_id)}", markdown=(
        f"# Rolled back to {restored}\n\n**Why:** {why}\n\n{outcome}"), description=f"rollback to {restored}")


def publish_stopped(repo_id: str, what: str, stopped_pgid: int | None) -> None:
    """A person stopped the host's server (`rollout stop`): the run history says who served until when."""
    outcome = (f"vLLM process group {stopped_pgid} stopped. Nothing serves on this host until a deploy or "
               "`rollout rollback`." if stopped_pgid else "Nothing was running.")
    create_markdown_artifact(key=f"stopped-{model_slug(repo_id)}", markdown=f"# Stopped {what} by hand\n\n"
                             f"- **Host:** {host_name()}\n\n{outcome}", description=f"stopped {what}")


# Benchmark and history
def publish_answers(report: AnswerReport, repo_id: str) -> None:
    """`answers-<model>`: each probe with the expected answer, the new output and the last good one."""
    verdict, markdown = answers_markdown(report)
    create_markdown_artifact(key=f"answers-{model_slug(repo_id)}", description=f"answer check {verdict}"[:200],
                             markdown=markdown)


def publish_files_comparison(comparison: FilesComparison, repo_id: str) -> None:
    """`files-<model>`: what changed in the model's files since the last good deployment, before the swap."""
    verdict, markdown = files_markdown(comparison)
    create_markdown_artifact(key=f"files-{model_slug(repo_id)}", description=f"files vs last good {verdict}"[:200],
                             markdown=markdown)


def publish_bench(results: list[LevelResult], repo_id: str, results_dir: Path) -> None:
    """The headline table (`bench-<model>`): what a reader decides by, rounded, units in the headers.
    Every figure in vLLM's names stays in the run's results.csv and per-level JSON."""
    table = headline_table(results)
    create_table_artifact(key=f"bench-{model_slug(repo_id)}", table=[
        {k: json_value(v) for k, v in row.items()} for row in table.to_dict(orient="records")],
        description=f"Concurrency sweep of {repo_id}; ± is the 95% interval. Every figure: {results_dir}/results.csv")


def publish_history_record(record: RunRecord) -> None:
    """One row per benchmarked run; the versions of `history-<model>` are the model's history."""
    create_table_artifact(key=HISTORY + model_slug(record.model), table=[record.model_dump(mode="json")],
                          description=f"{record.model}@{record.commit[:12]}: {record.status}")


def publish_comparison(table: pd.DataFrame, records: list[RunRecord], threshold: float) -> list[dict]:
    """The history table (`run-comparison`) and its summary: the verdict first, the history chart,
    then every run rounded with units and linked to its flow run."""
    rows = [{k: json_value(v) for k, v in row.items()} for row in table.to_dict(orient="records")]
    models = table["model"].nunique()
    create_table_artifact(key="run-comparison", table=rows, description=f"{len(rows)} runs of {models} model(s)")
    regressed = newest_regressed(table)
    verdict = (f"{len(regressed)} of {models} model(s) regressed in their newest run" if len(regressed)
               else f"no regression in the newest run of {models} model(s)")
    lines = [f"# Run comparison: {verdict}", "", f"{len(rows)} runs; regression threshold {threshold:.0%} against "
             "each model's previous good run on the same GPUs, outside the noise.", ""]
    lines += [f"- **Regressed:** {r.model} at {r.revision}: {r.regression}" for r in regressed.itertuples()]
    if (chart := history_chart(records)) is not None:
        lines += ["", f"![Throughput and p99 TTFT per revision over time]({png_data_uri(chart)})"]
    shown = readable(table)
    shown["revision"] = [run_link(run_id, rev) for run_id, rev in zip(table["flow_run_id"], table["revision"])]
    lines += ["", _markdown_table(shown)]
    create_markdown_artifact(key="run-comparison-summary", markdown="\n".join(lines), description=verdict)
    return rows


# The deploy run's summary
def _artifact_links(flow_run_id: str, skip: str) -> list[str]:
    """Every other artifact of the run, newest version of each key, as links to their UI pages."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])), sort=ArtifactSort.CREATED_DESC, limit=PAGE)
    links: dict[str, str] = {}
    for a in found:
        if a.key and a.key != skip and a.key not in links:
            links[a.key] = f"- [{a.key}]({ui_link(f'artifacts/artifact/{a.id}')}): {a.description or a.type}"
    return sorted(links.values())


def publish_deploy_summary(report: DeployReport) -> None:
    """`deploy-<model>` on the run itself, however it ended, rendered from the run's one report."""
    from prefect.runtime import flow_run

    key = f"deploy-{model_slug(report.repo_id)}"
    run_id = flow_run.get_id()
    links = _artifact_links(str(run_id), key) if run_id else []
    markdown = report.markdown(host=host_name(), run_link=run_link, artifact_links=links)
    create_markdown_artifact(key=key, markdown=markdown, description=report.verdict().replace("\n", " ")[:250])


# Tuning
def publish_tuning(repo_id: str, results: list[CandidateResult], best: CandidateResult | None, *, rule: str,
                   chart: bytes | None, promoted: bool) -> str:
    """`tune-<model>` (the report) and `tune-table-<model>` (the table alone). Returns the verdict line."""
    slug = model_slug(repo_id)
    rows = tuning_rows(results)
    create_table_artifact(key=f"tune-table-{slug}", table=rows, description=f"{len(rows)} candidates of {repo_id}")
    verdict, markdown = tuning_markdown(repo_id, results, best, rule=rule, chart=chart, promoted=promoted)
    create_markdown_artifact(key=f"tune-{slug}", markdown=markdown, description=verdict[:250])
    return verdict


# The nightly
def publish_nightly(repo_id: str, revision: str, verdict: str, *, body: str, deploy_run_id: str | None = None) -> None:
    """`nightly-<model>`: the verdict in its first line; the deploy it started linked, where it did."""
    link = (f"\n\nThe deploy run: {run_link(deploy_run_id, deploy_run_id)}, its summary is its "
            f"`deploy-{model_slug(repo_id)}` artifact." if deploy_run_id else "")
    create_markdown_artifact(key=f"nightly-{model_slug(repo_id)}", description=verdict[:250],
                             markdown=f"# {verdict}\n\nNightly refresh of `{repo_id}@{revision}`.\n\n{body}{link}")


# The fleet
def publish_fleet(report: FleetReport) -> None:
    """`fleet-<model>`: the verdict, then a row per host with its run linked; every mirror failure named;
    behind a router, the clients' view of the rollout."""
    rows = report.rows
    table = pd.DataFrame([{**{k: v for k, v in row.items() if k not in ("flow_run_id", "failures", "verdict")},
                           "run": run_link(row["flow_run_id"], "run") if row["flow_run_id"] else "-"}
                          for row in rows])
    table = table[[c for c in table.columns if c == "host" or table[c].astype(bool).any()]]  # drop empty columns
    mirror = report.mirror
    lines = [f"# {report.verdict}", "", f"- **Revision:** `{report.repo_id}@{report.commit}`",
             f"- **Canary:** {rows[0]['host']}; the hosts after it fetched from "
             + (f"its mirror {mirror}, each file held to the Hub's sha256" if mirror else "the Hub (no mirror set)"),
             *report.traffic_lines(), "", _markdown_table(table)]
    stopped = [row for row in rows if row["status"] not in ("serving", "untouched")]
    if stopped:
        lines += ["", "**Why it stopped:**", ""] + [f"- {row['host']}: {row['verdict']}" for row in stopped]
    failures = [(row["host"], f) for row in rows for f in row.get("failures", [])]
    if failures:
        lines += ["", f"**Mirror failures ({len(failures)})**, each file then fetched from the Hub and verified:", ""]
        lines += [f"- {host}: {what}" for host, what in failures]
    create_markdown_artifact(key=f"fleet-{model_slug(report.repo_id)}", markdown="\n".join(lines),
                             description=report.verdict[:250])
