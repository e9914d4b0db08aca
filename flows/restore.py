"""The one restore: a recorded good deployment started again, its secondary nodes first, after a
failed deploy (flows/deploy.py), a tune that stopped the serving model (flows/tune.py) and for
`rollout rollback` (flows/operate.py); and a multi-node group's nodes joining or leaving."""

from pathlib import Path

from prefect import get_run_logger
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.deployment.config import DeployConfig
from tasks.errors import first_line
from tasks.fleet.front import admit_behind_front, behind_front
from tasks.history.last_good import LastGood, write_last_good
from tasks.orchestration.artifacts import command_block, publish_rollback
from tasks.orchestration.remote_steps import join_on_host
from tasks.orchestration.steps import start_vllm


def join_group_nodes(members: list[tuple[str, DeployConfig]], action: str) -> None:
    """Each secondary node joins (or leaves) through its own host's worker, all at once; the first
    that fails raises, after the others have ended."""
    if not members:
        return
    with ThreadPoolTaskRunner(max_workers=len(members)) as runner:
        futures = [runner.submit(join_on_host, {"host": host, "config": c, "action": action}) for host, c in members]
        wait(futures)
        for future in futures:
            future.result()


def recorded_group(last: LastGood) -> list[tuple[str, DeployConfig]]:
    return [(g["host"], DeployConfig.model_validate(g["config"])) for g in last.group]


def left_behind(previous: LastGood, config: DeployConfig) -> list[tuple[str, DeployConfig]]:
    """The previous group's secondary nodes that the new deployment does not take over: their
    ranks would otherwise wait for a leader that is gone."""
    taken = {f.host for f in config.followers}
    return [(host, c) for host, c in recorded_group(previous) if host not in taken]


def restore_last_good(previous: LastGood, *, run_dir: Path, startup_timeout_s: float, why: str) -> tuple[str, bool]:
    """Start a recorded good deployment again, its secondary nodes first, and say why in an artifact:
    the one restore, after a failed deploy and for `rollout rollback`. Returns (what serves now, or
    why nothing does; whether the restore failed)."""
    logger = get_run_logger()
    what = previous.what
    logger.warning("%s; restarting the last good deployment, %s", why, what)
    try:
        join_group_nodes(recorded_group(previous), "join")
        handle, _ = start_vllm.with_options(task_run_name="restart last good")(
            behind_front(previous.server, run_dir, restore=True), run_dir, startup_timeout_s,
            api_key_secret=previous.api_key_secret, repo_id=previous.repo_id, failure_suffix="-rollback")
        front_url = admit_behind_front(run_dir, handle.base_url)  # where a front door runs: its clients come back
    except Exception as err:
        publish_rollback(previous.repo_id, what, why,
                         outcome=f"**Rollback failed:** `{first_line(err)}`. Nothing serves on this host now.")
        logger.error("rollback to %s failed: %s", what, first_line(err))
        return first_line(err), True
    write_last_good(run_dir, previous.model_copy(update={"serving_pgid": handle.pgid}))
    publish_rollback(previous.repo_id, what, why, outcome=(
        f"**Serving again:** `{previous.server.served_model_name}` ({what}) at {front_url or handle.base_url}, "
        f"ready in {handle.startup_s:.0f} s.\n\n{command_block(handle.command)}\n"))
    logger.warning("rolled back: %s serves again at %s", what, front_url or handle.base_url)
    return f"{what} at {front_url or handle.base_url}", False
