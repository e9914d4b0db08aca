"""The nightly refresh: a full deploy only when the tracked revision moved on the hub.

Most nights nothing changed upstream. Then the flow costs one hub call and ends in seconds with a
"no change" artifact: no download, no GPU time, no restart. When the revision points at a new
commit, deploy_model runs pinned to that commit, so what was checked is what gets deployed.
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.deploy import DeployConfig, deploy_model
from tasks.errors import HubUnreachable, first_line
from tasks.hub import hub_token, resolve_snapshot_task
from tasks.records import read_last_good
from tasks.report import model_slug
from tasks.server import serving_group


@flow(name="nightly-refresh")
def nightly_refresh(config: DeployConfig) -> str:
    """Returns "no-change" or "deployed"; a failed deploy (a regression included) fails the run."""
    logger = get_run_logger()
    key = f"nightly-{model_slug(config.repo_id)}"
    title = f"# Nightly refresh of {config.repo_id}@{config.revision}\n\n"
    try:
        with hub_token(config.hf_token_secret):
            snapshot = resolve_snapshot_task(config.repo_id, config.revision, config.hub_endpoint)
    except HubUnreachable as err:
        create_markdown_artifact(key=key, markdown=title + (
            f"**Hub unreachable:** {err}\n\nNothing was downloaded or restarted; what served keeps serving."))
        raise
    last = read_last_good(config.run_dir)
    if last is not None and last.repo_id == config.repo_id and last.commit == snapshot.commit:
        create_markdown_artifact(key=key, markdown=title + (
            f"**No change:** `{config.revision}` is still commit `{snapshot.commit}`, the last good deployment "
            f"on this host (`{last.model_dir}`). Nothing downloaded, nothing restarted."))
        logger.info("%s@%s is still %s: nothing to do", config.repo_id, config.revision, snapshot.commit[:12])
        return "no-change"
    was = f"`{last.repo_id}@{last.commit}`" if last else "nothing recorded"
    logger.info("%s@%s is now %s (last good: %s): deploying", config.repo_id, config.revision,
                snapshot.commit[:12], was)
    try:
        deploy_model(config.model_copy(update={"revision": snapshot.commit}))
    except Exception as err:
        now = read_last_good(config.run_dir)
        serving = now is not None and now.serving_pgid is not None and \
            serving_group(config.run_dir / "server.json") == now.serving_pgid
        create_markdown_artifact(key=key, markdown=title + (
            f"**Failed:** commit `{snapshot.commit}` did not deploy: `{first_line(err)}`.\n\n"
            + (f"**Serving:** the last good deployment, `{now.repo_id}@{now.commit}`." if serving
               else "**Serving:** nothing on this host.")))
        raise
    create_markdown_artifact(key=key, markdown=title + (
        f"**Deployed:** commit `{snapshot.commit}` (last good before: {was})."))
    return "deployed"
