"""The deploy flows: Hub repo in, benchmarked vLLM server's numbers out.

prepare_model (resolve, disk, fetch, validate) is its own flow so a model can be checked and staged
without touching the GPUs; deploy_model runs the same steps, then the GPU check, the swap of
servers and the sweep. Each body is the pipeline's steps; what they mean lives in tasks/.
"""

# No `from __future__ import annotations` here: Prefect validates flow parameters from the real
# annotation objects when a worker loads this module, and a string "DeployConfig" cannot be resolved.
import time
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.futures import wait
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.answers.check import AnswerBaseline
from tasks.bench.results import LevelResult
from tasks.bench.sweep import sweep, unusable_level
from tasks.deployment.config import DeployConfig
from tasks.deployment.stages import (
    DeployResult,
    PreparedModel,
    bench_facts,
    comparable,
    context_length,
    deployment_record,
    gpus_used,
    hardware_plan,
    parallelism,
    platform_label,
    server_config,
    vocab_size,
)
from tasks.disk import GB
from tasks.errors import (
    AnswerCheckFailed,
    BenchmarkFailed,
    FilesChanged,
    HostBusyError,
    RegressionError,
    first_line,
)
from tasks.gpu import GpuProbe
from tasks.history.last_good import (
    LastGood,
    promote_last_good,
    read_last_good,
    serving_deployment,
    write_last_good,
)
from tasks.history.runs import RunRecord, check_regression, run_record
from tasks.history.serving import check_state_files, take_over
from tasks.history.swap import abandoned_swap, begin_swap, end_swap
from tasks.history.tuned import read_tuned
from tasks.hub import RepoSnapshot, missing_bytes, record_revision, snapshot_dir
from tasks.orchestration.artifacts import (
    DeploySummary,
    FetchProgress,
    command_block,
    model_slug,
    publish_fetch,
    publish_rollback,
)
from tasks.orchestration.host_lock import host_lock, mark_crashed
from tasks.orchestration.notify import emit_rolled_back
from tasks.orchestration.run_labels import label_run
from tasks.orchestration.steps import (
    answer_check,
    bench_level,
    check_gpus,
    compare_with_last_good,
    evict_models,
    fetch,
    hub_token,
    join_on_host,
    plan_disk,
    prewarm_model,
    probe_gpus,
    publish_record,
    publish_results,
    resolve_revision,
    secret,
    start_vllm,
    stop_serving,
    stop_vllm,
    validate_local,
    validate_remote,
)
from tasks.vllm.command import warming_option_table
from tasks.vllm.gap import GapProbe, Unavailability
from tasks.vllm.process import ServerHandle, reap_stale, served_model, serving_headless, stop_server
from tasks.vllm.readiness import slow_start
from tasks.vllm.settings import ServerConfig

__all__ = ["DeployConfig", "DeployResult", "PreparedModel", "deploy_model", "prepare_model", "restore_last_good"]


@flow(name="prepare-model")
def prepare_model(config: DeployConfig) -> PreparedModel:
    """Pin the revision, make room, fetch every file in parallel, and check the checkpoint."""
    return prepare_steps(config)


def prepare_steps(config: DeployConfig, run_prefix: str = "") -> PreparedModel:
    """The prepare steps as tasks of the calling flow (deploy, tune), which they name after the
    model (`run_prefix` first). Not a prepare-model subflow: a task fed a subflow's result records a
    `flow_run` input, and Prefect's UI then lists none of the run's task runs (PrefectHQ/prefect#18680)."""
    logger = get_run_logger()
    label_run(config.repo_id, config.revision, prefix=run_prefix)  # findable even when the hub does not answer
    with hub_token(config.hf_token_secret):
        snapshot = resolve_revision(config.repo_id, config.revision, config.hub_endpoint)
        label_run(config.repo_id, config.revision, snapshot.commit, prefix=run_prefix)
        logger.info("%s@%s is commit %s: %d files, %.2f GB", config.repo_id, config.revision, snapshot.commit,
                    len(snapshot.files), snapshot.total_bytes / GB)
        validate_remote(snapshot, config.hub_endpoint)
        needed = missing_bytes(snapshot, config.cache_dir)
        _make_room(config, snapshot, needed)
        _fetch_all(config, snapshot, needed)
        model_dir = snapshot_dir(snapshot, config.cache_dir)
        report = validate_local(model_dir, config.repo_id)
    return PreparedModel(repo_id=config.repo_id, commit=snapshot.commit, model_dir=model_dir,
                         total_bytes=snapshot.total_bytes, validation=report)


def _make_room(config: DeployConfig, snapshot: RepoSnapshot, needed: int) -> None:
    """Plan the disk (never the served, pinned or fallback model) and delete what the plan lists."""
    logger = get_run_logger()
    last_good = read_last_good(config.run_dir)
    plan = plan_disk(config.models_root, needed, int(config.disk_margin_gb * GB), (snapshot.repo_id, snapshot.commit),
                     served_model(config.run_dir / "server.json"), config.pinned_models,
                     last_good.model_dir if last_good else None, not config.evict)
    for warning in plan.warnings:
        logger.warning(warning)
    if plan.evictions:
        evicted = evict_models(plan, config.models_root, config.repo_id)
        logger.info("deleted %s: free %.2f -> %.2f GB", ", ".join(evicted.deleted),
                    evicted.free_before_bytes / GB, evicted.free_after_bytes / GB)


def _fetch_all(config: DeployConfig, snapshot: RepoSnapshot, needed: int) -> None:
    """One fetch task per file, max_parallel_downloads at once, small files first (cheap early failures)."""
    logger = get_run_logger()
    progress = FetchProgress(snapshot.total_bytes, snapshot.total_bytes - needed, config.repo_id)
    started = time.perf_counter()
    with ThreadPoolTaskRunner(max_workers=config.max_parallel_downloads) as downloads:
        futures = [downloads.submit(fetch, {"snapshot": snapshot, "file": f, "cache_dir": config.cache_dir,
                                            "endpoint": config.hub_endpoint, "on_bytes": progress.add,
                                            "mirror": config.mirror_endpoint})
                   for f in sorted(snapshot.files, key=lambda f: f.size)]
        wait(futures)
        results = [future.result() for future in futures]  # raises the first failed fetch with its own message
    wall_s = time.perf_counter() - started
    progress.finish()
    record_revision(snapshot, config.cache_dir)
    publish_fetch(results, wall_s, config.repo_id)
    downloaded = sum(r.downloaded for r in results)
    if downloaded:
        logger.info("fetched %.2f GB in %.1f s (%.1f MB/s)", downloaded / GB, wall_s, downloaded / 1e6 / wall_s)
    else:
        logger.info("all %d files already in the cache at %s: nothing fetched", len(results), snapshot.commit[:12])


def _reap_server(flow, flow_run, state) -> None:
    """Cancellation and crash hooks: the vLLM group outlives the flow unless someone stops it.

    The host's current deployment is not the flow's to stop: a run cancelled while it was still
    fetching leaves the old server serving.
    """
    config = DeployConfig.model_validate(flow_run.parameters["config"])
    last_good = read_last_good(config.run_dir)
    reap_stale(config.run_dir / "server.json", keep_pgid=last_good.serving_pgid if last_good else None)


@flow(name="deploy-model", on_cancellation=[_reap_server], on_crashed=[_reap_server])
def deploy_model(config: DeployConfig) -> DeployResult:
    """Fetch and check the model while the current one still serves, then swap servers; a failure
    after the swap brings the last good deployment back. However it ends, the run's summary says how."""
    summary = DeploySummary(config.repo_id, config.revision)
    try:
        result = _deploy(config, summary)
    except BaseException as err:  # SIGTERM, Ctrl-C and a cancel too: the summary says how it ended
        try:
            summary.publish(err)
            if summary.rollback is not None:
                emit_rolled_back(config.repo_id, summary.verdict(err))  # the automation tells a person
        except Exception as lost:  # the API may be going away with the process: the error stands
            get_run_logger().warning("the run's summary was not published: %s", first_line(lost))
        raise
    summary.publish()
    return result


def _deploy(config: DeployConfig, summary: DeploySummary) -> DeployResult:
    logger = get_run_logger()
    tuned = read_tuned(config.run_dir, config.repo_id) if config.use_tuned else None
    if tuned is not None and config.followers:
        # A tune run measures one host; its layout would undo the group's (nnodes, ranks, addresses).
        logger.warning("not serving with the settings a tune run promoted on %s (%s): they were measured on this "
                       "host alone, and this deploy is a group over %d nodes", f"{tuned.time:%Y-%m-%d %H:%M}",
                       tuned.candidate, len(config.followers) + 1)
    elif tuned is not None:
        logger.info("serving with the settings a tune run promoted on %s: %s", f"{tuned.time:%Y-%m-%d %H:%M}",
                    tuned.candidate)
        config = config.model_copy(update={"vllm": tuned.settings})
    with host_lock(run_dir=config.run_dir):  # first: reaping a "stale" server is only safe when no other deploy runs
        if config.take_over and (stopped := take_over(config.run_dir)):
            logger.warning("took over the host: damaged records set aside, vLLM process groups %s stopped", stopped)
        check_state_files(config.run_dir)
        if (crashed := mark_crashed(abandoned_swap(config.run_dir))) is not None:
            logger.warning("flow run %s died mid-swap; marked Crashed", crashed)
        if serving_headless(config.run_dir / "server.json"):
            raise HostBusyError("this host runs a secondary node of a multi-node group led from another host: "
                                "deploy on the leader, or run this host's join-group with leave first")
        previous = serving_deployment(config.run_dir)  # keeps serving while the new model comes in
        if previous is None and (stale := reap_stale(config.run_dir / "server.json")) is not None:
            logger.warning("stopped vLLM process group %d left by an earlier run", stale)
        summary.serving_before = f"{previous.repo_id}@{previous.commit[:12]}" if previous else None
        with warming_option_table(config.run_dir):  # a bad flag is then refused in ms, not after a load
            prepared = prepare_steps(config)
            summary.commit = prepared.commit
            gpu = probe_gpus()
            for warning in check_gpus(gpu, hardware_plan(config, prepared), config.repo_id):
                logger.warning("%s: %s", warning.rule, warning.message)
        server = server_config(config, prepared, gpu.platform)
        last_good = previous or read_last_good(config.run_dir)
        summary.last_good = comparable(last_good, config.repo_id)
        same_weights = _check_files(config, prepared, last_good)
        if config.prewarm and previous is not None:  # nothing serves otherwise: vLLM's own load is as fast
            summary.prewarm = prewarm_model(prepared.model_dir, keep_warm=previous.model_dir,
                                            margin_gb=config.prewarm_margin_gb).text()
        # From here until a server is promoted or restored, a guard outlives this process: if it dies
        # (kill -9), the unchecked server is stopped and the last good one brought back.
        begin_swap(config.run_dir, what=f"{config.repo_id}@{prepared.commit[:12]}", models_root=config.models_root,
                   flow_run_id=str(flow_run.get_id() or "") or None)
        old_pgid = previous.serving_pgid if previous else None
        try:
            # A client's view of the swap: one-token completions every 0.5 s to whatever server the
            # host records, from before the old one stops until the next one answers.
            with GapProbe(config.run_dir / "server.json", api_key=secret(config.api_key_secret)) as probe:

                if old_pgid is None:
                    probe.pause()  # nothing served before: no gap to measure, and no load to add

                def swap_gap(new_pgid: int | None) -> Unavailability | None:
                    if old_pgid is None:
                        return None
                    if new_pgid is not None:
                        probe.wait_for_answer(new_pgid)
                    summary.unavailable = probe.gap(old_pgid=old_pgid, new_pgid=new_pgid)
                    probe.pause()  # until a failure needs the restore's first answer
                    return summary.unavailable

                if previous is not None:  # from here a failure restores it
                    probe.wait_for_answer(old_pgid)  # the old server's last answer is the gap's start
                    stop_serving(config.run_dir, summary.serving_before)
                    _group(_left_behind(previous, config), "leave")
                    summary.previous_stopped = True
                try:
                    _group(config.group_members(), "join")  # the leader waits for every rank at start-up
                    handle, record, rows, stop = _serve_and_bench(config, prepared, gpu, server, summary,
                                                                  same_weights=same_weights, swap_gap=swap_gap)
                except BaseException as err:  # SIGTERM and Ctrl-C too: the host must not be left serving nothing
                    try:
                        _group(config.group_members(), "leave")
                    except Exception as left:  # a node that cannot leave must not keep the last good one down
                        logger.warning("the new group's secondary nodes did not all stop: %s", first_line(left))
                    if previous is not None:
                        probe.resume()
                        summary.rollback, summary.rollback_failed = restore_last_good(
                            previous, run_dir=config.run_dir, startup_timeout_s=config.startup_timeout_s,
                            why=f"the new deployment failed after the old server was stopped: `{first_line(err)}`")
                        restored = read_last_good(config.run_dir)
                        swap_gap(None if summary.rollback_failed or restored is None else restored.serving_pgid)
                    raise
            promote_last_good(config.run_dir, deployment_record(config, prepared, handle, server, record))
        finally:
            end_swap(config.run_dir)
        summary.base_url = handle.base_url if config.keep_serving else None
    return DeployResult(prepared=prepared, platform=gpu.platform, results=rows, sweep_end=stop, record=record,
                        base_url=summary.base_url)


def _check_files(config: DeployConfig, prepared: PreparedModel, last_good: LastGood | None) -> bool:
    """Another commit of the last good model: its files compared with the last good ones while that
    still serves, and a change that alters what the same weights mean refused before the swap.
    Returns whether the weights are the very same files (then any flipped probe fails)."""
    if last_good is None or last_good.repo_id != config.repo_id:
        return False
    if last_good.commit == prepared.commit:
        return True
    if not last_good.model_dir.is_dir():
        get_run_logger().warning("the last good deployment's files are gone from %s: not compared", last_good.model_dir)
        return False
    comparison = compare_with_last_good(prepared.model_dir, last_good, repo_id=config.repo_id, spec=config.answers)
    if comparison.problems:
        raise FilesChanged(f"{config.repo_id}@{prepared.commit[:12]}: " + "; ".join(comparison.problems))
    return comparison.same_weights


def _serve_and_bench(config: DeployConfig, prepared: PreparedModel, gpu: GpuProbe, server: ServerConfig,
                     summary: DeploySummary, *, same_weights: bool,
                     swap_gap) -> tuple[ServerHandle, RunRecord, list[LevelResult], str | None]:
    """Start (readiness includes a real token), check its answers, sweep, publish, compare; wrong
    answers or a regression raise, with the run in the history either way."""
    logger = get_run_logger()
    last_run = summary.last_good
    handle, facts = start_vllm(server, config.run_dir, config.startup_timeout_s, config.api_key_secret,
                               config.repo_id, last_good_startup=last_run.startup if last_run else None)
    if slow := slow_start(facts.phases, last_run.startup if last_run else None):
        logger.warning("slow start: %s", slow)
        summary.slow_start = slow
    gap = swap_gap(handle.pgid)  # ends at the new server's first answer to a client, if it is promoted

    def record_of(rows: list[LevelResult], answers: AnswerBaseline | None, *, promoted: bool = True) -> RunRecord:
        """The run's history record; the swap's gap only where this server goes on serving (a failed
        one's gap ends at the restored server's answer: the summary has it)."""
        return run_record(rows, config.repo_id, config.revision, prepared.commit, platform_label(gpu),
                          facts.vllm_version, parallelism(config.vllm), str(flow_run.get_id() or "") or None,
                          answers, config.bench.load, gap.seconds if gap and promoted else None,
                          startup=facts.phases)

    try:
        logger.info("vLLM ready at %s after %.0f s", handle.base_url, handle.startup_s)
        summary.facts = bench_facts(config, prepared, gpu, facts)
        answers = None
        if config.answers.enabled:
            report = answer_check(handle.base_url, server.served_model_name, config.answers,
                                  model_dir=prepared.model_dir, last_good=last_run.answers if last_run else None,
                                  same_commit=last_run is not None and last_run.commit == prepared.commit,
                                  same_weights=same_weights, repo_id=config.repo_id, api_key=handle.api_key,
                                  max_model_len=context_length(prepared.model_dir, config.vllm),
                                  vocab_size=vocab_size(prepared.model_dir), settings=config.vllm)
            answers = report.baseline
            if not report.passed:
                why = "; ".join(report.problems)
                summary.record = publish_record(record_of([], answers, promoted=False).model_copy(
                    update={"status": "failed", "note": why}))
                raise AnswerCheckFailed(f"{config.repo_id}@{prepared.commit[:12]}: {why}")
            logger.info("answer check passed: %.0f%% of %d probes right", 100 * report.accuracy, len(report.results))
        summary.results_dir = (config.run_dir / "bench" / model_slug(config.repo_id)
                               / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
        vocab, stops, gpus = vocab_size(prepared.model_dir), [], gpus_used(gpu, config.vllm)
        rows = sweep(config.bench, lambda c: bench_level(handle.base_url, server.served_model_name, config.bench, c,
                                                         vocab, prepared.model_dir, handle.api_key,
                                                         summary.results_dir, gpus),
                     stops.append)
        for reason in stops:
            logger.info("%s; the sweep stops", reason)
        summary.results, summary.stop = rows, stops[0] if stops else None
        publish_results(rows, config.repo_id, summary.facts, summary.results_dir, summary.stop, gpus)
        if failed := unusable_level(rows):
            why = f"every request failed at concurrency {failed.concurrency}: {failed.first_error}"
            summary.record = publish_record(record_of(rows, answers, promoted=False).model_copy(
                update={"status": "failed", "note": why}))
            raise BenchmarkFailed(f"{config.repo_id}@{prepared.commit[:12]}: {why}")
        record = check_regression(last_run, record_of(rows, answers), config.max_regression)
        if record.status == "regressed":
            record = record.model_copy(update={"unavailable_s": None})  # it will not go on serving
        record = summary.record = publish_record(record)
        if record.status == "regressed":
            raise RegressionError(f"{config.repo_id}@{prepared.commit[:12]} {record.note}")
    except BaseException:
        stop_server(handle)  # not a task: on cancellation the run may create no more task runs
        raise
    if not config.keep_serving:
        stop_vllm(handle)
    return handle, record, rows, summary.stop


def _group(members: list[tuple[str, DeployConfig]], action: str) -> None:
    """Each secondary node joins (or leaves) through its own host's worker, all at once; the first
    that fails raises, after the others have ended."""
    if not members:
        return
    with ThreadPoolTaskRunner(max_workers=len(members)) as runner:
        futures = [runner.submit(join_on_host, {"host": host, "config": c, "action": action}) for host, c in members]
        wait(futures)
        for future in futures:
            future.result()


def _recorded_group(last: LastGood) -> list[tuple[str, DeployConfig]]:
    return [(g["host"], DeployConfig.model_validate(g["config"])) for g in last.group]


def _left_behind(previous: LastGood, config: DeployConfig) -> list[tuple[str, DeployConfig]]:
    """The previous group's secondary nodes that the new deployment does not take over: their
    ranks would otherwise wait for a leader that is gone."""
    taken = {f.host for f in config.followers}
    return [(host, c) for host, c in _recorded_group(previous) if host not in taken]


def restore_last_good(previous: LastGood, *, run_dir: Path, startup_timeout_s: float, why: str) -> tuple[str, bool]:
    """Start a recorded good deployment again, its secondary nodes first, and say why in an artifact:
    the one restore, after a failed deploy and for `rollout rollback`. Returns (what serves now, or
    why nothing does; whether the restore failed)."""
    logger = get_run_logger()
    what = f"{previous.repo_id}@{previous.commit[:12]}"
    logger.warning("%s; restarting the last good deployment, %s", why, what)
    try:
        _group(_recorded_group(previous), "join")
        handle, _ = start_vllm.with_options(task_run_name="restart last good")(
            previous.server, run_dir, startup_timeout_s, previous.api_key_secret, previous.repo_id, "-rollback")
    except Exception as err:
        publish_rollback(previous.repo_id, what, why,
                         f"**Rollback failed:** `{first_line(err)}`. Nothing serves on this host now.")
        logger.error("rollback to %s failed: %s", what, first_line(err))
        return first_line(err), True
    write_last_good(run_dir, previous.model_copy(update={"serving_pgid": handle.pgid}))
    publish_rollback(previous.repo_id, what, why, (
        f"**Serving again:** `{previous.server.served_model_name}` ({what}) at {handle.base_url}, "
        f"ready in {handle.startup_s:.0f} s.\n\n{command_block(handle.command)}\n"))
    logger.warning("rolled back: %s serves again at %s", what, handle.base_url)
    return f"{what} at {handle.base_url}", False
