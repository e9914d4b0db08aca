"""The deploy flow: Hub repo in, benchmarked vLLM server's numbers out.

deploy_model runs prepare's steps (flows/prepare.py) while the current model still serves, then the
GPU check, the swap of servers and the sweep, and publishes one report however it ends. Each body
is the pipeline's steps; what they mean lives in tasks/.
"""

# No `from __future__ import annotations` here: Prefect validates flow parameters from the real
# annotation objects when a worker loads this module, and a string "DeployConfig" cannot be resolved.
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.prepare import prepare_steps
from flows.restore import join_group_nodes, left_behind, restore_last_good
from tasks.answers.check import AnswerBaseline
from tasks.bench.results import LevelResult
from tasks.bench.sweep import unusable_level
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
from tasks.deployment.summary import DeployReport, Restored, Served
from tasks.errors import (
    AnswerCheckFailed,
    BenchmarkFailed,
    FilesChanged,
    HostBusyError,
    RegressionError,
    first_line,
)
from tasks.fleet.front import admit_behind_front, behind_front
from tasks.gpu import GpuProbe
from tasks.history.last_good import (
    LastGood,
    promote_last_good,
    read_last_good,
    serving_deployment,
)
from tasks.history.runs import RunRecord, check_regression, run_record
from tasks.history.serving import check_state_files, take_over
from tasks.history.swap import abandoned_swap, begin_swap, end_swap
from tasks.history.tuned import read_tuned
from tasks.names import model_slug
from tasks.orchestration.artifacts import publish_deploy_summary
from tasks.orchestration.host_lock import host_lock, mark_crashed
from tasks.orchestration.notify import emit_rolled_back
from tasks.orchestration.steps import (
    answer_check,
    bench_level,
    check_gpus,
    compare_with_last_good,
    prestart_vllm,
    prewarm_model,
    probe_gpus,
    publish_record,
    publish_results,
    secret,
    start_vllm,
    stop_serving,
    stop_vllm,
)
from tasks.profiles.families import family_line
from tasks.serving import Serving
from tasks.vllm.command import warming_option_table
from tasks.vllm.gap import GapProbe, Unavailability
from tasks.vllm.process import (
    Prestarted,
    ServerHandle,
    cancel_prestart,
    reap_stale,
    serving_group,
    serving_headless,
)
from tasks.vllm.readiness import slow_start
from tasks.vllm.settings import ServerConfig

__all__ = ["DeployConfig", "DeployResult", "PreparedModel", "deploy_model", "restore_last_good"]


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
    result, report = _deploy(config)
    try:
        publish_deploy_summary(report)
        if report.restored is not None:
            emit_rolled_back(config.repo_id, report.verdict())  # the automation tells a person
    except Exception as lost:
        if report.error is None:
            raise
        get_run_logger().warning("the run's summary was not published: %s", first_line(lost))  # the error stands
    if report.error is not None:
        raise report.error  # SIGTERM, Ctrl-C and a cancel too, after the summary said how the run ended
    return result


def _deploy(config: DeployConfig) -> tuple[DeployResult | None, DeployReport]:
    """The pipeline's steps, and the run's one report built from what they returned, however far
    they got; the error that stopped them goes in the report, to be raised once it is published."""
    report = DeployReport(config.repo_id, config.revision, keep_serving=config.keep_serving)
    previous = None
    try:
        config = _with_tuned_settings(config)
        with host_lock(run_dir=config.run_dir):  # first: reaping a "stale" server is safe only when no deploy runs
            previous = _claim_host(config)  # keeps serving while the new model comes in
            report = replace(report, serving_before=_what(previous))
            with warming_option_table(config.run_dir):  # a bad flag is then refused in ms, not after a load
                prepared = prepare_steps(config)
                report = replace(report, commit=prepared.commit)
                gpu = probe_gpus()
                for warning in check_gpus(gpu, hardware_plan(config, prepared), config.repo_id):
                    get_run_logger().warning("%s: %s", warning.rule, warning.message)
            last_good = previous or read_last_good(config.run_dir)
            last_run = comparable(last_good, config.repo_id)
            same_weights = _check_files(config, prepared, last_good)
            prewarm = None
            if config.prewarm and previous is not None:  # nothing serves otherwise: vLLM's own load is as fast
                prewarm = prewarm_model(prepared.model_dir, keep_warm=previous.model_dir,
                                        margin_gb=config.prewarm_margin_gb).text()
            report = replace(report, last_good=last_run, prewarm=prewarm)
            server = server_config(config, prepared.model_dir, gpu.platform)
            if line := family_line(config.vllm, prepared.model_dir):
                get_run_logger().info(line)
            served, restored = _swap(config, previous, prepared, server, gpu=gpu, last_run=last_run,
                                     same_weights=same_weights)
            report = replace(report, previous_stopped=_stopped(previous, config.run_dir), served=served,
                             restored=restored, error=served.error)
    except BaseException as err:  # SIGTERM, Ctrl-C and a cancel too: the summary says how the run ended
        return None, replace(report, previous_stopped=_stopped(previous, config.run_dir), error=err)
    if report.error is not None:
        return None, report
    return DeployResult(prepared=prepared, platform=gpu.platform, results=served.results, sweep_end=served.stop,
                        record=served.record, base_url=report.base_url), report


def _stopped(previous: LastGood | None, run_dir: Path) -> bool:
    """Whether the server that served before the run no longer does: asked of the host (its process
    group), not of the steps that ran; a host that cannot say is taken as serving nothing."""
    if previous is None:
        return False
    try:
        return serving_group(run_dir / "server.json") != previous.serving_pgid
    except Exception:
        return True


def _what(deployment: LastGood | None) -> str | None:
    return deployment.what if deployment else None


def _with_tuned_settings(config: DeployConfig) -> DeployConfig:
    """The settings a tune run promoted on this host, where they apply."""
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
        return config.model_copy(update={"vllm": tuned.settings})
    return config


def _claim_host(config: DeployConfig) -> LastGood | None:
    """With the host lock held: damaged records refused (or set aside on --take-over), a swap that
    died marked Crashed, a stale server reaped. Returns the deployment serving now, if any."""
    logger = get_run_logger()
    if config.take_over and (stopped := take_over(config.run_dir)):
        logger.warning("took over the host: damaged records set aside, vLLM process groups %s stopped", stopped)
    check_state_files(config.run_dir)
    if warning := config.exposure_warning():  # said in the run's log, whoever started it (UI, nightly, CLI)
        logger.warning(warning)
    if (crashed := mark_crashed(abandoned_swap(config.run_dir))) is not None:
        logger.warning("flow run %s died mid-swap; marked Crashed", crashed)
    if serving_headless(config.run_dir / "server.json"):
        raise HostBusyError("this host runs a secondary node of a multi-node group led from another host: "
                            "deploy on the leader, or run this host's join-group with leave first")
    previous = serving_deployment(config.run_dir)
    if previous is None and (stale := reap_stale(config.run_dir / "server.json")) is not None:
        logger.warning("stopped vLLM process group %d left by an earlier run", stale)
    return previous


def _swap(config: DeployConfig, previous: LastGood | None, prepared: PreparedModel, server: ServerConfig, *,
          gpu: GpuProbe, last_run: RunRecord | None, same_weights: bool) -> tuple[Served, Restored | None]:
    """Stop the old server, start, check and sweep the new one, and promote it; a failure after the
    stop brings the last good one back. A guard outlives this process from the first step: if it dies
    (kill -9), the unchecked server is stopped and the last good one brought back."""
    logger = get_run_logger()
    begin_swap(config.run_dir, what=f"{config.repo_id}@{prepared.commit[:12]}", models_root=config.models_root,
               flow_run_id=str(flow_run.get_id() or "") or None)
    old_pgid = previous.serving_pgid if previous else None
    launch = behind_front(server, config.run_dir)  # where a front door runs: a private port until admitted
    prestarted = None
    try:
        # A client's view of the swap: one-token completions every 0.25 s to whatever server the
        # host records, from before the old one stops until the next one answers.
        with GapProbe(config.run_dir / "server.json", api_key=secret(config.api_key_secret)) as probe:

            def admit(handle: ServerHandle) -> tuple[str | None, Unavailability | None]:
                """Where a front door runs: its clients sent to the checked server. Returns the front's
                URL and the clients' gap, from the old server's last answer to the admission."""
                front_url = admit_behind_front(config.run_dir, handle.base_url)
                if front_url is None or old_pgid is None:
                    return front_url, None
                return front_url, probe.held(old_pgid=old_pgid)

            def swap_gap(new_pgid: int | None) -> Unavailability | None:
                if old_pgid is None:
                    return None
                if new_pgid is not None:
                    probe.wait_for_answer(new_pgid)
                gap = probe.gap(old_pgid=old_pgid, new_pgid=new_pgid)
                probe.pause()  # until a failure needs the restore's first answer
                return gap.model_copy(update={"held": launch is not server})  # behind a front: clients waited

            if previous is None:
                probe.pause()  # nothing served before: no gap to measure, and no load to add
            elif config.prestart:  # the new server's imports while the old one answers
                prestarted = prestart_vllm(launch, config.run_dir, api_key_secret=config.api_key_secret)
            stop_begun = False
            try:
                if previous is not None:
                    probe.wait_for_answer(old_pgid)  # the old server's last answer is the gap's start
                    stop_begun = True  # from here a failure, a SIGTERM in the stop included, restores it
                    stop_serving(config.run_dir, previous.what)
                    join_group_nodes(left_behind(previous, config), "leave")
                join_group_nodes(config.group_members(), "join")  # the leader waits for every rank at start-up
                served = _serve_and_bench(config, prepared, gpu, launch, last_run=last_run,
                                          same_weights=same_weights, swap_gap=swap_gap, admit=admit,
                                          prestarted=prestarted)
            except BaseException as err:  # a stop or a start that failed: nothing new was served
                served = Served(error=err)
            if served.error is None:
                promote_last_good(config.run_dir, deployment_record(config, prepared, served.handle, server=server,
                                                                    record=served.record))
                return served, None
            try:  # SIGTERM and Ctrl-C too: the host must not be left serving nothing
                join_group_nodes(config.group_members(), "leave")
            except Exception as left:  # a node that cannot leave must not keep the last good one down
                logger.warning("the new group's secondary nodes did not all stop: %s", first_line(left))
            if previous is None or not stop_begun:  # the old server was never touched: it serves on
                return served, None
            if serving_group(config.run_dir / "server.json") is not None:  # a stop cut short, finished first
                stop_serving(config.run_dir, "what the interrupted swap left running")
            probe.resume()
            what, failed = restore_last_good(
                previous, run_dir=config.run_dir, startup_timeout_s=config.startup_timeout_s,
                why=f"the new deployment failed after the old server was stopped: `{first_line(served.error)}`")
            restored = read_last_good(config.run_dir)
            return served, Restored(what=what, failed=failed, unavailable=swap_gap(
                None if failed or restored is None else restored.serving_pgid))
    finally:
        if prestarted is not None:  # one whose gate never opened (the stop failed): ended, not left waiting
            cancel_prestart(prestarted)
        end_swap(config.run_dir)


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


def _serve_and_bench(config: DeployConfig, prepared: PreparedModel, gpu: GpuProbe, server: ServerConfig, *,
                     last_run: RunRecord | None, same_weights: bool,
                     swap_gap: Callable[[int | None], Unavailability | None],
                     admit: Callable[[ServerHandle], tuple[str | None, Unavailability | None]],
                     prestarted: Prestarted | None = None) -> Served:
    """Start (readiness includes a real token), check its answers, sweep, publish, compare. Wrong
    answers or a regression end it with the run in the history either way; what stopped it is the
    result's `error`, the server stopped. A start that fails raises."""
    logger = get_run_logger()
    handle, facts = start_vllm(server, config.run_dir, config.startup_timeout_s, api_key_secret=config.api_key_secret,
                               repo_id=config.repo_id, last_good_startup=last_run.startup if last_run else None,
                               prestarted=prestarted)
    served = Served(handle=handle, slow_start=slow_start(facts.phases, last_run.startup if last_run else None))
    if served.slow_start:
        logger.warning("slow start: %s", served.slow_start)
    served = replace(served, unavailable=swap_gap(handle.pgid))  # ends at the new server's first answer to a client

    def record_of(rows: list[LevelResult], answers: AnswerBaseline | None, *, promoted: bool = True) -> RunRecord:
        """The run's history record; the swap's gap only where this server goes on serving (a failed
        one's gap ends at the restored server's answer: the summary has it)."""
        gap = served.unavailable
        return run_record(rows, config.repo_id, config.revision, commit=prepared.commit, gpu=platform_label(gpu),
                          vllm_version=facts.vllm_version, parallelism=parallelism(config.vllm),
                          flow_run_id=str(flow_run.get_id() or "") or None, answers=answers, load=config.bench.load,
                          unavailable_s=gap.seconds if gap and promoted else None, startup=facts.phases)

    try:
        with Serving(handle=handle, keep_serving=config.keep_serving, stop=stop_vllm) as serving:
            logger.info("vLLM ready at %s after %.0f s", handle.base_url, handle.startup_s)
            served = replace(served, facts=bench_facts(config, prepared, gpu, server=facts))
            answers = None
            if config.answers.enabled:
                report = answer_check(handle.base_url, server.served_model_name, config.answers,
                                      model_dir=prepared.model_dir, last_good=last_run.answers if last_run else None,
                                      same_commit=last_run is not None and last_run.commit == prepared.commit,
                                      same_weights=same_weights, repo_id=config.repo_id, api_key=handle.api_key,
                                      max_model_len=context_length(prepared.model_dir, config.vllm),
                                      vocab_size=vocab_size(prepared.model_dir), settings=server)
                answers = report.baseline
                if not report.passed:
                    why = "; ".join(report.problems)
                    served = replace(served, record=publish_record(record_of([], answers, promoted=False).model_copy(
                        update={"status": "failed", "note": why})))
                    raise AnswerCheckFailed(f"{config.repo_id}@{prepared.commit[:12]}: {why}")
                logger.info("answer check passed: %.0f%% of %d probes right", 100 * report.accuracy,
                            len(report.results))
            results_dir = (config.run_dir / "bench" / model_slug(config.repo_id)
                           / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
            served = replace(served, results_dir=results_dir)
            vocab, gpus = vocab_size(prepared.model_dir), gpus_used(gpu, config.vllm)
            swept = serving.sweep(config.bench, lambda c: bench_level(
                handle.base_url, server.served_model_name, config.bench, concurrency=c, vocab_size=vocab,
                tokenizer=prepared.model_dir, api_key=handle.api_key, results_dir=results_dir, gpus=gpus))
            if swept.stop:
                logger.info("%s; the sweep stops", swept.stop)
            rows = swept.rows
            served = replace(served, results=rows, stop=swept.stop)
            publish_results(rows, config.repo_id, served.facts, results_dir=results_dir, stop=served.stop, gpus=gpus)
            if failed := unusable_level(rows):
                why = f"every request failed at concurrency {failed.concurrency}: {failed.first_error}"
                served = replace(served, record=publish_record(record_of(rows, answers, promoted=False).model_copy(
                    update={"status": "failed", "note": why})))
                raise BenchmarkFailed(f"{config.repo_id}@{prepared.commit[:12]}: {why}")
            record = check_regression(last_run, record_of(rows, answers), config.max_regression)
            if record.status == "regressed":
                record = record.model_copy(update={"unavailable_s": None})  # it will not go on serving
            elif config.keep_serving:  # every check passed: a front door's clients reach it from here
                front_url, held = admit(handle)
                served = replace(served, front_url=front_url, unavailable=held or served.unavailable)
                record = record.model_copy(update={"unavailable_s": served.unavailable.seconds
                                                   if served.unavailable else None})
            served = replace(served, record=publish_record(record))
            if served.record.status == "regressed":
                raise RegressionError(f"{config.repo_id}@{prepared.commit[:12]} {served.record.note}")
    except BaseException as err:  # the server is stopped by then (Serving): SIGTERM, Ctrl-C, a cancel too
        return replace(served, error=err)
    return served
