"""The Prefect task layer: each step is one domain call with its name, retries, cache policy and
tags, and the artifact it publishes. Flows call these; the domain modules never import Prefect
(an import-linter contract in pyproject.toml holds them to it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from prefect import get_run_logger, task
from prefect.blocks.system import Secret
from prefect.cache_policies import NO_CACHE

from tasks.answers.check import AnswerBaseline, AnswerReport
from tasks.answers.files import FilesComparison, compare_files
from tasks.answers.server_check import check_answers
from tasks.answers.spec import AnswerSpec
from tasks.bench.load import run_level
from tasks.bench.report import save_results
from tasks.bench.results import LevelResult
from tasks.bench.spec import BenchSpec
from tasks.checkpoint.rules import (
    ValidationReport,
    validate_checkpoint,
    validate_snapshot,
)
from tasks.disk import DiskPlan, EvictionResult, check_plan, evict, plan_space
from tasks.errors import GpuConfigError, ServerStartError, ValidationFailed
from tasks.findings import Violation
from tasks.fleet.front import hold_at_front
from tasks.gpu import (
    GpuProbe,
    HardwarePlan,
    check_hardware,
    energy_meter,
    hardware_warnings,
    probe,
)
from tasks.history.last_good import LastGood
from tasks.history.runs import RunRecord
from tasks.hub import (
    FetchResult,
    RepoFile,
    RepoSnapshot,
    fetch_file,
    is_transient,
    resolve_snapshot,
)
from tasks.orchestration import artifacts
from tasks.prewarm import Prewarm, prewarm
from tasks.profiles.families import chat_modes
from tasks.profiles.remote_code import code_in_dir, code_in_snapshot, require_consent
from tasks.tuning.measure import CandidateResult, measure, refusal
from tasks.tuning.space import Candidate
from tasks.vllm.process import (
    Prestarted,
    ServerHandle,
    cancel_prestart,
    prestart_server,
    reap_stale,
    stop_server,
    wait_imported,
)
from tasks.vllm.readiness import ServerFacts, running_facts, start_and_wait
from tasks.vllm.settings import ServerConfig, VllmSettings


def secret(block: str | None) -> str | None:
    """A Prefect Secret block's value, read where it is used: never a parameter, log or artifact."""
    return Secret.load(block).get() if block else None


@contextlib.contextmanager
def hub_token(secret_block: str | None) -> Iterator[None]:
    """The token from a Prefect Secret block, where huggingface_hub looks for it (HF_TOKEN).

    Through the environment, not as an argument: task parameters, logs and artifacts never hold it.
    Without a block, HF_TOKEN or the stored login applies as usual.
    """
    if not secret_block:
        yield
        return
    before = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = secret(secret_block)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_TOKEN", None)
        else:
            os.environ["HF_TOKEN"] = before


def _retry_transient(task, task_run, state) -> bool:
    return is_transient(state.result(raise_on_failure=False))


# Hub
@task(name="resolve-revision", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=_retry_transient)
def resolve_revision(repo_id: str, revision: str, endpoint: str | None = None) -> RepoSnapshot:
    return resolve_snapshot(repo_id, revision, endpoint)


@task(
    name="fetch-file",
    task_run_name="fetch {file.path}",
    tags=["hub-download"],
    retries=8,  # the fetch's one retry budget: every try resumes from the bytes on disk
    retry_delay_seconds=[1, 2, 4, 8, 15, 30, 30, 30],
    retry_jitter_factor=0.5,
    retry_condition_fn=_retry_transient,
    cache_policy=NO_CACHE,  # the HF cache is the cache; a progress callback is not hashable anyway
)
def fetch(snapshot: RepoSnapshot, file: RepoFile, cache_dir: Path, *, endpoint: str | None = None,
          on_bytes: Callable[[int], None] = lambda n: None, mirror: str | None = None) -> FetchResult:
    return fetch_file(snapshot, file, cache_dir, endpoint=endpoint, on_bytes=on_bytes, mirror=mirror)


# Validation
def _require_pass(report: ValidationReport, stage: str) -> ValidationReport:
    if report.verdict == "fail":
        first = report.violations[0]
        raise ValidationFailed(f"{report.source}: {len(report.violations)} violation(s) {stage}, first "
                               f"`{first.rule}` {first.module}: {first.message}")
    return report


@task(name="validate-remote", tags=["validate"], retries=2, retry_delay_seconds=[5, 30],
      retry_condition_fn=_retry_transient)
def validate_remote(snapshot: RepoSnapshot, endpoint: str | None) -> ValidationReport:
    """The same rules on the hub's headers first: a bad checkpoint costs seconds, not a download."""
    report = validate_snapshot(snapshot, endpoint)
    artifacts.publish_validation(report, snapshot.repo_id, "remote")
    return _require_pass(report, "remote")


@task(name="remote-code", retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=_retry_transient)
def check_remote_code(snapshot: RepoSnapshot, endpoint: str | None, *, run_dir: Path, consent: bool) -> list[str]:
    """The repo's code that vLLM would execute, refused before any download without the operator's
    consent (given now, or recorded for this repo); the Python files it names."""
    code = code_in_snapshot(snapshot, endpoint)
    line = require_consent(code, repo_id=snapshot.repo_id, commit=snapshot.commit, run_dir=run_dir, given=consent)
    if line:
        get_run_logger().warning(line)
    return code.modules


@task(name="validate-checkpoint", tags=["validate"])
def validate_local(model_dir: Path, repo_id: str) -> ValidationReport:
    report = validate_checkpoint(model_dir)
    artifacts.publish_validation(report, repo_id, "local")
    return _require_pass(report, "local")


# Disk
@task(name="plan-disk", tags=["disk"])
def plan_disk(models_root: Path, needed_bytes: int, margin_bytes: int, *, target: tuple[str, str],
              served: Path | None, pinned: list[str], fallback: Path | None, dry_run: bool) -> DiskPlan:
    plan = plan_space(models_root, needed_bytes, margin_bytes, target=target, served=served, pinned=pinned,
                      fallback=fallback)
    artifacts.publish_disk_plan(plan, target[0], dry_run)
    check_plan(plan, dry_run)
    return plan


@task(name="evict-models", tags=["disk"])
def evict_models(plan: DiskPlan, models_root: Path, repo_id: str) -> EvictionResult:
    result = evict(plan, models_root)
    artifacts.publish_eviction(result, repo_id)
    return result


# GPUs and vLLM
@task(name="probe-gpus", tags=["gpu"])
def probe_gpus() -> GpuProbe:
    return probe()


@task(name="check-hardware", tags=["gpu"])
def check_gpus(gpu: GpuProbe, plan: HardwarePlan, repo_id: str) -> list[Violation]:
    """Publish the verdict; raise on a blocking problem so nothing is started on a box that cannot serve."""
    blocking, warnings = check_hardware(gpu, plan), hardware_warnings(gpu, plan)
    artifacts.publish_hardware(gpu, plan, blocking + warnings, passed=not blocking, repo_id=repo_id)
    if blocking:
        raise GpuConfigError(f"{blocking[0].rule}: {blocking[0].message}")
    return warnings


@task(name="prestart-vllm", tags=["vllm"], cache_policy=NO_CACHE)
def prestart_vllm(cfg: ServerConfig, run_dir: Path, *, api_key_secret: str | None,
                  import_timeout_s: float = 300.0) -> Prestarted:
    """The new server launched while the old one still answers, held at its gate once its imports are
    done. A vLLM that cannot even import fails here, with the old server still serving."""
    pre = prestart_server(cfg, run_dir, secret(api_key_secret))
    try:
        waited = wait_imported(pre, import_timeout_s)
    except BaseException:
        cancel_prestart(pre)
        raise
    get_run_logger().info("prestart: vLLM imported in %.1f s, held at its gate until the old server stops", waited)
    return pre


@task(name="start-vllm", tags=["vllm"], cache_policy=NO_CACHE)
def start_vllm(cfg: ServerConfig, run_dir: Path, timeout_s: float, *, api_key_secret: str | None,
               repo_id: str, failure_suffix: str = "", last_good_startup: dict[str, float] | None = None,
               prestarted: Prestarted | None = None) -> tuple[ServerHandle, ServerFacts]:
    """Launch (or open the gate of the one prestarted) and wait until vLLM serves a real token (5-15
    minutes for a 1T model); the task's duration is the load. Its start-up log goes to the Prefect
    log as it comes; its phases are published beside the last good start's."""
    try:
        handle = start_and_wait(cfg, run_dir, timeout_s, api_key=secret(api_key_secret), report=get_run_logger().info,
                                prestarted=prestarted)
    except ServerStartError as err:
        artifacts.publish_server_failure(err, repo_id, failure_suffix)
        raise
    facts = running_facts(handle)
    artifacts.publish_server(facts, handle.command, repo_id, last_good=last_good_startup)
    return handle, facts


@task(name="stop-vllm", tags=["vllm"], cache_policy=NO_CACHE)
def stop_vllm(handle: ServerHandle) -> None:
    stop_server(handle)


@task(name="prewarm", tags=["disk"], cache_policy=NO_CACHE)
def prewarm_model(model_dir: Path, *, keep_warm: Path | None, margin_gb: float) -> Prewarm:
    """The new shards into the page cache while the old server still answers; said in the log."""
    done = prewarm(model_dir, keep_warm=keep_warm, margin_bytes=int(margin_gb * 1e9))
    get_run_logger().info("prewarm: %s", done.text())
    return done


@task(name="stop-serving", task_run_name="stop {what}", tags=["vllm"], cache_policy=NO_CACHE)
def stop_serving(run_dir: Path, what: str) -> None:
    """The host's current server, stopped so the new model gets the GPUs (one model at a time).
    Where a front door runs, its clients are held there first (their requests in flight finish):
    they wait for the next server admitted instead of being refused."""
    if (drained := hold_at_front(run_dir)) is not None:
        get_run_logger().info("front door: clients held until the next server is admitted (drained in %.1f s)",
                              drained)
    reap_stale(run_dir / "server.json")


# Answers
@task(name="compare-files", tags=["answers"], cache_policy=NO_CACHE)
def compare_with_last_good(model_dir: Path, last_good: LastGood, *, repo_id: str,
                           spec: AnswerSpec) -> FilesComparison:
    """The new revision's tokenizer, templates and configs against the last good one's, published;
    the flow decides what a failing change means (it raises before the swap)."""
    comparison = compare_files(model_dir, last_good.model_dir, last_good=last_good.what,
                               allow_changes=spec.allow_changed_files, code_runs=bool(code_in_dir(model_dir).needed))
    artifacts.publish_files_comparison(comparison, repo_id)
    return comparison


@task(name="answer-check", tags=["answers"], cache_policy=NO_CACHE)
def answer_check(base_url: str, model: str, spec: AnswerSpec, *, model_dir: Path, last_good: AnswerBaseline | None,
                 same_commit: bool, same_weights: bool, repo_id: str, api_key: str | None = None,
                 max_model_len: int | None = None, vocab_size: int | None = None,
                 settings: VllmSettings | None = None) -> AnswerReport:
    """The check, published; the flow decides what a failed one means (it records it, then raises)."""
    report = check_answers(base_url, model, spec.for_model(model_dir), last_good=last_good, same_commit=same_commit,
                           same_weights=same_weights, api_key=api_key, max_model_len=max_model_len,
                           vocab_size=vocab_size,
                           tools=bool(settings and settings.enable_auto_tool_choice and settings.tool_call_parser),
                           reasoning=bool(settings and settings.reasoning_parser),
                           max_num_seqs=settings.max_num_seqs if settings else None, modes=chat_modes(model_dir))
    artifacts.publish_answers(report, repo_id)
    return report


# Benchmark and history
@task(name="bench-level", task_run_name="bench c={concurrency}", tags=["bench"], cache_policy=NO_CACHE)
def bench_level(base_url: str, model: str, spec: BenchSpec, *, concurrency: int, vocab_size: int | None,
                tokenizer: Path | None, api_key: str | None = None, results_dir: Path | None = None,
                gpus: int | None = None) -> LevelResult:
    """One level; on `gpus` GPUs it reports throughput per GPU, and tokens per joule where NVML counts energy."""
    with energy_meter(gpus) if gpus else contextlib.nullcontext() as meter:
        return run_level(base_url, model, spec, concurrency=concurrency, vocab_size=vocab_size, tokenizer=tokenizer,
                         api_key=api_key, results_dir=results_dir,
                         energy=meter, gpus=gpus)


@task(name="publish-results", tags=["report"])
def publish_results(results: list[LevelResult], repo_id: str, facts: dict[str, str], *, results_dir: Path,
                    stop: str | None, gpus: int | None = None) -> None:
    save_results(results, results_dir, f"Benchmark of {repo_id}", facts=facts, stop=stop, gpus=gpus)
    artifacts.publish_bench(results, repo_id, results_dir)


@task(name="publish-history-record", tags=["report"], cache_policy=NO_CACHE)
def publish_record(record: RunRecord) -> RunRecord:
    artifacts.publish_history_record(record)
    return record


# Tuning
@task(name="check-candidate", task_run_name="check {candidate.name}", tags=["tune"], cache_policy=NO_CACHE)
def check_candidate(candidate: Candidate, gpu: GpuProbe, plan: HardwarePlan, *, server: ServerConfig,
                    cache_dir: Path) -> CandidateResult | None:
    """The hardware rules and vLLM's parser, in milliseconds: a refusal names the rule or the flag."""
    return refusal(candidate, check_hardware(gpu, plan), server, cache_dir=cache_dir)


def _candidate_key(context, parameters) -> str:
    return parameters["key"]


@task(name="measure-candidate", task_run_name="measure {candidate.name}", tags=["tune", "vllm"],
      cache_key_fn=_candidate_key, persist_result=True)
def measure_candidate(key: str, candidate: Candidate, server: ServerConfig, *, run_dir: Path, timeout_s: float,
                      api_key_secret: str | None, answers: AnswerSpec, model_dir: Path, bench: BenchSpec,
                      vocab_size: int | None, gpus: int) -> CandidateResult:
    """Cached under `key` (model commit, vLLM version, GPUs, load, settings): a search run again, or
    resumed after an interruption, measures only what it has not measured yet."""
    return measure(candidate, server, run_dir, timeout_s=timeout_s, api_key=secret(api_key_secret), answers=answers,
                   model_dir=model_dir, bench=bench,
                   vocab_size=vocab_size, gpus=gpus, report=get_run_logger().info)


def is_measured(key: str) -> bool:
    """Whether measure-candidate holds a result under `key`: a search whose every candidate is cached
    leaves the serving model alone."""
    from prefect.results import get_result_store

    return get_result_store().update_for_task(measure_candidate).exists(key)
