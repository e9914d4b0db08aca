"""The deploy flow: Hub repo in, benchmarked vLLM server's numbers out.

prepare_model (resolve, disk, fetch, validate) is its own flow so a model can be checked and staged
without touching the GPUs; deploy_model composes it with the GPU probe, vLLM and the sweep.
"""

# No `from __future__ import annotations` here: Prefect validates flow parameters from the real
# annotation objects when a worker loads this module, and a string "DeployConfig" cannot be resolved.
import json
import time
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.futures import wait
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, Field

from tasks.artifacts import FetchProgress, model_slug, publish_fetch, publish_rollback
from tasks.bench import BenchSpec, sweep
from tasks.disk import GB
from tasks.errors import RegressionError, first_line
from tasks.gpu import HardwarePlan, kv_cache_is_fp8
from tasks.history import RunRecord, check_regression, run_record
from tasks.host_lock import host_lock
from tasks.hub import missing_bytes, record_revision, snapshot_dir
from tasks.records import LastGood, read_last_good, write_last_good
from tasks.server import (
    ServerConfig,
    ServerHandle,
    VllmSettings,
    reap_stale,
    served_model,
    serving_group,
    stop_server,
    warm_option_table,
)
from tasks.steps import (
    bench_level,
    check_gpus,
    evict_models,
    fetch,
    hub_token,
    plan_disk,
    probe_gpus,
    publish_record,
    publish_results,
    resolve_revision,
    secret,
    start_vllm,
    stop_vllm,
    validate_local,
    validate_remote,
)
from tasks.validate import ValidationReport


class DeployConfig(BaseModel):
    """What to deploy and how to benchmark it; the Prefect UI renders this as the run form."""

    repo_id: str = Field(..., description="Hugging Face model repo, e.g. moonshotai/Kimi-K2.5")
    revision: str = Field("main", description="Branch, tag or commit; resolved to a commit sha before download")
    models_root: Path = Field(Path("/models"), description="Filesystem that holds the HF cache (models_root/hub)")
    hub_endpoint: str | None = Field(None, description="Hub URL; empty uses HF_ENDPOINT or huggingface.co")
    hf_token_secret: str | None = Field(None, description="Prefect Secret block with the HF token; empty: HF_TOKEN")
    disk_margin_gb: float = Field(10.0, ge=0, description="Free space to keep beyond the model's size")
    evict: bool = Field(False, description="Delete what the disk plan lists; off is a dry run that only plans")
    pinned_models: list[str] = Field(default_factory=list,
                                     description="Never evicted: repo ids, repo@commit, or model folder paths")
    max_parallel_downloads: int = Field(8, ge=1, le=64, description="Files fetched at once")
    served_model_name: str | None = Field(None, description="Name clients use; defaults to repo_id")
    vllm: VllmSettings = Field(default_factory=lambda: VllmSettings(enable_expert_parallel=True),
                               description="vLLM engine settings")
    host: str = Field("127.0.0.1", description="Address vLLM listens on; 0.0.0.0 serves other machines")
    port: int = Field(8000, ge=0, le=65535, description="Server port; 0 picks a free one")
    api_key_secret: str | None = Field(None, description="Prefect Secret block holding the server's API key")
    startup_timeout_s: float = Field(1800, gt=0, description="Load deadline; a 1T model takes 5-15 minutes")
    bench: BenchSpec = Field(default_factory=BenchSpec, description="Benchmark load and sweep")
    keep_serving: bool = Field(True, description="Leave the new server serving after its benchmark (the "
                               "deployment); off stops it, and a server it replaced stays stopped")
    max_regression: float | None = Field(0.1, ge=0, lt=1,
                                         description="Fail and roll back when single-stream or peak tok/s falls "
                                         "(or p99 TTFT grows) by more than this fraction against the last good "
                                         "deployment of the same model on this host; empty: no check")

    @property
    def cache_dir(self) -> Path:
        return self.models_root / "hub"

    @property
    def run_dir(self) -> Path:
        """Server state file and log, one per host: there is one server per models root."""
        return self.models_root / ".rollout"


class PreparedModel(BaseModel):
    repo_id: str
    commit: str
    model_dir: Path
    total_bytes: int
    validation: ValidationReport


class DeployResult(BaseModel):
    prepared: PreparedModel
    platform: str
    results: list[dict]
    record: RunRecord  # the history record: its `compared` says how this run stands against the last good one
    base_url: str | None = None  # where the new deployment serves; None when keep_serving was off


@flow(name="prepare-model")
def prepare_model(config: DeployConfig) -> PreparedModel:
    """Pin the revision, make room, fetch every file in parallel, and check the checkpoint."""
    return _prepare(config)


def _prepare(config: DeployConfig) -> PreparedModel:
    """The prepare steps as tasks of the calling flow. deploy_model runs them in its own run, not as a
    prepare-model subflow: a task fed a subflow's result records a `flow_run` input, and Prefect's UI
    then lists none of the run's task runs (PrefectHQ/prefect#18680)."""
    with hub_token(config.hf_token_secret):
        return _prepare_with_token(config)


def _prepare_with_token(config: DeployConfig) -> PreparedModel:
    logger = get_run_logger()
    snapshot = resolve_revision(config.repo_id, config.revision, config.hub_endpoint)
    logger.info("%s@%s is commit %s: %d files, %.2f GB", config.repo_id, config.revision, snapshot.commit,
                len(snapshot.files), snapshot.total_bytes / GB)
    validate_remote(snapshot, config.hub_endpoint)

    needed = missing_bytes(snapshot, config.cache_dir)
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

    progress = FetchProgress(snapshot.total_bytes, snapshot.total_bytes - needed, config.repo_id)
    files = sorted(snapshot.files, key=lambda f: f.size)  # config and tokenizer first: cheap early failures
    started = time.perf_counter()
    with ThreadPoolTaskRunner(max_workers=config.max_parallel_downloads) as downloads:
        futures = [downloads.submit(fetch, {"snapshot": snapshot, "file": f, "cache_dir": config.cache_dir,
                                                      "endpoint": config.hub_endpoint, "on_bytes": progress.add})
                   for f in files]
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

    model_dir = snapshot_dir(snapshot, config.cache_dir)
    report = validate_local(model_dir, config.repo_id)
    return PreparedModel(repo_id=config.repo_id, commit=snapshot.commit, model_dir=model_dir,
                         total_bytes=snapshot.total_bytes, validation=report)


def _vocab_size(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


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
    after the swap brings the last good deployment back."""
    # The host lock comes first: reaping a "stale" server is only safe when no other deploy runs.
    with host_lock():
        return _deploy(config)


def _serving(handle: ServerHandle, config: ServerConfig) -> ServerConfig:
    """The launch as it really ran: port 0 became a real port, which a restore must take again."""
    return config.model_copy(update={"port": int(handle.base_url.rsplit(":", 1)[1])})


def _restore(previous: LastGood, run_dir: Path, startup_timeout_s: float, reason: BaseException,
             repo_id: str) -> None:
    """Start the last good deployment again and say why in an artifact; the new deploy's error stands."""
    logger = get_run_logger()
    what = f"{previous.repo_id}@{previous.commit[:12]}"
    logger.warning("new deployment failed (%s); restarting the last good one, %s", first_line(reason), what)
    try:
        handle, _ = start_vllm.with_options(task_run_name="restart last good")(
            previous.server, run_dir, startup_timeout_s, previous.api_key_secret, repo_id, "-rollback")
    except Exception as err:
        publish_rollback(repo_id, what, reason,
                         f"**Rollback failed:** `{first_line(err)}`. Nothing serves on this host now.")
        logger.error("rollback to %s failed: %s", what, first_line(err))
        return
    write_last_good(run_dir, previous.model_copy(update={"serving_pgid": handle.pgid}))
    publish_rollback(repo_id, what, reason, (
        f"**Serving again:** `{previous.server.served_model_name}` ({what}) at {handle.base_url}, "
        f"ready in {handle.startup_s:.0f} s.\n\n```\n{' '.join(handle.command)}\n```\n"))
    logger.warning("rolled back: %s serves again at %s", what, handle.base_url)


def _deploy(config: DeployConfig) -> DeployResult:
    logger = get_run_logger()
    state_file = config.run_dir / "server.json"
    last_good = read_last_good(config.run_dir)
    current = serving_group(state_file)
    if current is not None and (last_good is None or last_good.serving_pgid != current or last_good.server is None):
        logger.warning("stopped vLLM process group %d left by an earlier run", reap_stale(state_file))
        current = None
    previous = last_good if current is not None else None  # serving now: keeps serving while we fetch
    warming = warm_option_table(config.run_dir)  # so a bad flag is refused in ms once the model is in place
    try:
        prepared = _prepare(config)
        gpu = probe_gpus()
        logger.info("platform %s: %s", gpu.platform, ", ".join(g.name for g in gpu.gpus) or gpu.reason)
        plan = HardwarePlan(
            tensor_parallel_size=config.vllm.tensor_parallel_size,
            weights_bytes=prepared.validation.total_bytes,
            kv_cache_fp8=kv_cache_is_fp8(prepared.validation.kv_cache_scheme, config.vllm.kv_cache_dtype),
            gpu_memory_utilization=config.vllm.gpu_memory_utilization or 0.9,  # vLLM's default
        )
        for warning in check_gpus(gpu, plan, config.repo_id):
            logger.warning("%s: %s", warning.rule, warning.message)

        env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(int(config.startup_timeout_s))}
        if gpu.platform == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default would take a large share of RAM
        server_cfg = ServerConfig(
            **config.vllm.model_dump(exclude={"env"}),
            env={**env, **config.vllm.env},
            model_path=prepared.model_dir,
            served_model_name=config.served_model_name or config.repo_id,
            host=config.host,
            port=config.port,
        )
        if warming is not None:
            warming.wait(timeout=120)
    finally:  # a flow that fails before launch leaves no parser child behind
        if warming is not None and warming.poll() is None:
            warming.kill()
            warming.wait()
    if previous is not None:  # the GPUs hold one model at a time: from here a failure restores this one
        reap_stale(state_file)
        logger.info("stopped the serving %s@%s to start the new deployment", previous.repo_id, previous.commit[:12])
    try:
        handle, record, rows = _serve_and_bench(config, prepared, gpu, server_cfg, previous or last_good)
    except Exception as err:
        if previous is not None:
            _restore(previous, config.run_dir, config.startup_timeout_s, err, config.repo_id)
        raise
    write_last_good(config.run_dir, LastGood(
        repo_id=prepared.repo_id, commit=prepared.commit, model_dir=prepared.model_dir, revision=config.revision,
        server=_serving(handle, server_cfg), api_key_secret=config.api_key_secret,
        serving_pgid=handle.pgid if config.keep_serving else None, record=record))
    return DeployResult(prepared=prepared, platform=gpu.platform, results=rows, record=record,
                        base_url=handle.base_url if config.keep_serving else None)


def _serve_and_bench(config: DeployConfig, prepared: PreparedModel, gpu, server_cfg: ServerConfig,
                     last_good: LastGood | None) -> tuple[ServerHandle, RunRecord, list[dict]]:
    """Start, smoke-test (wait_ready generates a token), sweep, record; a regression raises."""
    logger = get_run_logger()
    handle, server = start_vllm(server_cfg, config.run_dir, config.startup_timeout_s, config.api_key_secret,
                                config.repo_id)
    api_key = secret(config.api_key_secret)
    try:
        logger.info("vLLM ready at %s after %.0f s", handle.base_url, handle.startup_s)
        spec = config.bench
        started = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        results_dir = config.run_dir / "bench" / model_slug(config.repo_id) / started
        vocab = _vocab_size(prepared.model_dir)
        stops: list[str] = []
        rows = sweep(spec, lambda c: bench_level(handle.base_url, server_cfg.served_model_name, spec, c, vocab,
                                                 prepared.model_dir, api_key, results_dir), stops.append)
        for reason in stops:
            logger.info("%s; the sweep stops", reason)
        platform = gpu.platform + (f" ({len(gpu.gpus)}x {gpu.gpus[0].name})" if gpu.gpus else "")
        parallelism = (f"TP={config.vllm.tensor_parallel_size}, "
                       f"EP={'on' if config.vllm.enable_expert_parallel else 'off'}")
        facts = {
            "Revision": f"{config.revision} ({prepared.commit[:12]})",
            "Platform": platform,
            "Parallelism": parallelism,
            "Load": (f"{spec.api}, input {spec.input_len}, output {spec.output_len} tokens, "
                     + (f"{spec.request_rate} req/s (burstiness {spec.burstiness})" if spec.request_rate
                        else "all requests at once") + f", {spec.requests_per_level} per level"),
            **({"SLO": ", ".join(f"{k} <= {v:g} ms" for k, v in spec.slos_ms.items())
                + f" for {spec.slo_attainment:.0%} of requests"} if spec.slos_ms else {}),
            "vLLM": f"{server['vllm_version']}, ready in {server['startup_s']} s, KV cache "
                    f"{server.get('kv_cache_tokens', '?')} tokens",
        }
        publish_results(rows, config.repo_id, facts, results_dir, stops[0] if stops else None)
        run = flow_run.get_id()
        record = check_regression(
            last_good.record if last_good and last_good.repo_id == config.repo_id else None,
            run_record(rows, config.repo_id, config.revision, prepared.commit, platform, server["vllm_version"],
                       parallelism, str(run) if run else None),
            config.max_regression)
        publish_record(record)
        if record.status == "regressed":
            raise RegressionError(f"{config.repo_id}@{prepared.commit[:12]} {record.note}")
    except BaseException:
        stop_server(handle)  # not a task: on cancellation the run may create no more task runs
        raise
    if not config.keep_serving:
        stop_vllm(handle)
    return handle, record, rows
