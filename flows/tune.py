"""The tune flow: the best serving configuration of a prepared model, found by measurement.

Each candidate of the space is checked in milliseconds (the hardware rules, vLLM's own parser), then
the survivors are measured one after another on the host's GPUs, with the deployment's own start,
answer check and sweep. Measurements are Prefect task results keyed by model commit, vLLM version,
GPUs, load and settings: a search run again or resumed measures only what it has not.
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
import time
from datetime import datetime, timezone
from typing import Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from flows.restore import restore_last_good
from flows.prepare import prepare_steps
from tasks.deployment.config import DeployConfig
from tasks.deployment.stages import gpus_used, hardware_plan, platform_label, server_config, vocab_size
from tasks.errors import RolloutError
from tasks.history.last_good import read_last_good, serving_deployment
from tasks.history.swap import begin_swap, end_swap
from tasks.history.tuned import TunedSettings, write_tuned
from tasks.orchestration.artifacts import publish_tuning
from tasks.orchestration.host_lock import host_lock
from tasks.orchestration.steps import (
    check_candidate,
    is_measured,
    measure_candidate,
    probe_gpus,
    secret,
    stop_serving,
)
from tasks.tuning.chart import pareto_chart
from tasks.tuning.measure import CandidateResult, winner
from tasks.tuning.space import TuneSpace, candidate_key, candidates
from tasks.vllm.command import warming_option_table
from tasks.vllm.gap import GapProbe
from tasks.vllm.options import installed_version


class TuneConfig(BaseModel):
    deploy: DeployConfig = Field(..., description="The model, its base vLLM settings, the answer check and the load")
    space: TuneSpace = Field(default_factory=TuneSpace, description="The candidates: each list an axis")
    winner_rule: Literal["peak", "single-stream"] = Field("peak", description="peak: best throughput within the "
                                                          "SLO, single stream breaking ties; single-stream: best "
                                                          "single stream")
    max_hours: float | None = Field(None, gt=0, description="Stop measuring after this long; what was measured "
                                                            "is reported")
    promote: bool = Field(False, description="Make the winner's settings this host's deployment settings for the "
                                             "model (the next deploy and nightly use them)")


@flow(name="tune-model")
def tune_model(config: TuneConfig) -> list[CandidateResult]:
    """Candidates in order, likeliest winner first; the host lock held throughout, the serving model
    stopped for the search and started again after it."""
    logger = get_run_logger()
    deploy = config.deploy.model_copy(update={"use_tuned": False})
    started = time.monotonic()
    with host_lock(run_dir=deploy.run_dir):
        if warning := deploy.exposure_warning():
            logger.warning(warning)
        previous = serving_deployment(deploy.run_dir)
        with warming_option_table(deploy.run_dir):
            prepared = prepare_steps(deploy, run_prefix="tune ")
            gpu = probe_gpus()
        stopped = False  # the serving model is stopped only for a candidate that must be measured
        results: list[CandidateResult] = []
        vocab, measured_on = vocab_size(prepared.model_dir), (installed_version() or "unknown",
                                                               f"{platform_label(gpu)} at {deploy.run_dir}")
        # The host's gap as a client sees it, from the serving model's last answer to its restart's
        # first; no probe while the candidates are measured (load they did not ask for).
        probe = GapProbe(deploy.run_dir / "server.json", api_key=secret(previous.api_key_secret) if previous else None)
        probe.pause()
        with probe:
            try:
                for candidate in candidates(deploy.vllm, config.space):
                    form = deploy.model_copy(update={"vllm": candidate.settings})
                    server = server_config(form, prepared.model_dir, gpu.platform)
                    refused = check_candidate(candidate, gpu, hardware_plan(form, prepared), server=server,
                                              cache_dir=deploy.run_dir)
                    if refused is not None:
                        logger.info("%s: refused by %s in %.0f ms", candidate.name, refused.cause,
                                    refused.seconds * 1000)
                        results.append(refused)
                        continue
                    if config.max_hours and time.monotonic() - started > config.max_hours * 3600:
                        results.append(CandidateResult(name=candidate.name, settings=candidate.settings,
                                                       status="not measured", cause="max_hours"))
                        continue
                    gpus = gpus_used(gpu, candidate.settings) or 1
                    key = candidate_key(candidate, prepared.commit, vllm_version=measured_on[0],
                                        gpus=measured_on[1], bench=deploy.bench,
                                        answers=deploy.answers.for_model(prepared.model_dir))
                    if previous is not None and not stopped and not is_measured(key):
                        begin_swap(deploy.run_dir, what=f"tune of {deploy.repo_id}", models_root=deploy.models_root)
                        probe.resume()
                        probe.wait_for_answer(previous.serving_pgid)  # the gap starts at its last answer
                        probe.pause()
                        stop_serving(deploy.run_dir, previous.what)
                        stopped = True
                    results.append(measure_candidate(
                        key, candidate, server, run_dir=deploy.run_dir, timeout_s=deploy.startup_timeout_s,
                        api_key_secret=deploy.api_key_secret, answers=deploy.answers, model_dir=prepared.model_dir,
                        bench=deploy.bench, vocab_size=vocab, gpus=gpus))
            finally:
                if stopped:  # the host serves what it served before the search: the one restore
                    probe.resume()
                    what, failed = restore_last_good(previous, run_dir=deploy.run_dir,
                                                     startup_timeout_s=deploy.startup_timeout_s,
                                                     why="the tune run stopped it to measure candidates")
                    end_swap(deploy.run_dir)
                    if failed:
                        raise RolloutError(f"the serving model did not start again after the tune: {what}")
                    restarted = read_last_good(deploy.run_dir).serving_pgid
                    probe.wait_for_answer(restarted)
                    logger.warning("unavailable during the tune: %s",
                                   probe.gap(old_pgid=previous.serving_pgid, new_pgid=restarted).text())
        best = winner(results, config.winner_rule)
        if config.promote and best is not None:
            write_tuned(deploy.run_dir, TunedSettings(repo_id=deploy.repo_id, settings=best.settings,
                                                      candidate=best.name, time=datetime.now(timezone.utc),
                                                      flow_run_id=str(flow_run.get_id() or "") or None))
    logger.info(publish_tuning(deploy.repo_id, results, best, rule=config.winner_rule,
                               chart=pareto_chart(results, best), promoted=config.promote))
    return results
