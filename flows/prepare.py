"""The prepare flow: pin the revision, make room, fetch every file in parallel, check the checkpoint.

A flow of its own so a model can be checked and staged without touching the GPUs; deploy, tune and
a group's secondary node run the same steps as tasks of their own runs (`prepare_steps`).
"""

# No `from __future__ import annotations`: Prefect validates flow parameters from real annotations.
import time

from prefect import flow, get_run_logger
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.deployment.config import DeployConfig
from tasks.deployment.stages import PreparedModel
from tasks.disk import GB
from tasks.history.last_good import read_last_good
from tasks.hub import RepoSnapshot, missing_bytes, record_revision, snapshot_dir
from tasks.orchestration.artifacts import FetchProgress, publish_fetch
from tasks.orchestration.run_labels import label_run
from tasks.orchestration.steps import (
    check_remote_code,
    evict_models,
    fetch,
    hub_token,
    plan_disk,
    resolve_revision,
    validate_local,
    validate_remote,
)
from tasks.vllm.process import served_model


@flow(name="prepare-model")
def prepare_model(config: DeployConfig) -> PreparedModel:
    """Pin the revision, make room, fetch every file in parallel, and check the checkpoint."""
    return prepare_steps(config, will_serve=False)  # staging runs nothing of the repo's code


def prepare_steps(config: DeployConfig, run_prefix: str = "", *, will_serve: bool = True) -> PreparedModel:
    """The prepare steps as tasks of the calling flow (deploy, tune), which they name after the
    model (`run_prefix` first). Not a prepare-model subflow: a task fed a subflow's result records a
    `flow_run` input, and Prefect's UI then lists none of the run's task runs (PrefectHQ/prefect#18680).
    A run that will serve the model first asks whether its repo ships code vLLM would execute."""
    logger = get_run_logger()
    label_run(config.repo_id, config.revision, prefix=run_prefix)  # findable even when the hub does not answer
    with hub_token(config.hf_token_secret):
        snapshot = resolve_revision(config.repo_id, config.revision, config.hub_endpoint)
        label_run(config.repo_id, config.revision, snapshot.commit, prefix=run_prefix)
        logger.info("%s@%s is commit %s: %d files, %.2f GB", config.repo_id, config.revision, snapshot.commit,
                    len(snapshot.files), snapshot.total_bytes / GB)
        remote_code = check_remote_code(snapshot, config.hub_endpoint, run_dir=config.run_dir,
                                        consent=config.vllm.trust_remote_code) if will_serve else []
        validate_remote(snapshot, config.hub_endpoint)
        needed = missing_bytes(snapshot, config.cache_dir)
        _make_room(config, snapshot, needed)
        _fetch_all(config, snapshot, needed)
        model_dir = snapshot_dir(snapshot, config.cache_dir)
        report = validate_local(model_dir, config.repo_id)
    return PreparedModel(repo_id=config.repo_id, commit=snapshot.commit, model_dir=model_dir,
                         total_bytes=snapshot.total_bytes, validation=report, remote_code=remote_code)


def _make_room(config: DeployConfig, snapshot: RepoSnapshot, needed: int) -> None:
    """Plan the disk (never the served, pinned or fallback model) and delete what the plan lists."""
    logger = get_run_logger()
    last_good = read_last_good(config.run_dir)
    plan = plan_disk(config.models_root, needed, int(config.disk_margin_gb * GB),
                     target=(snapshot.repo_id, snapshot.commit), served=served_model(config.run_dir / "server.json"),
                     pinned=config.pinned_models, fallback=last_good.model_dir if last_good else None,
                     dry_run=not config.evict)
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
