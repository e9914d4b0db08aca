"""The nightly refresh: a full deploy only when the tracked revision moved on the hub.

Most nights nothing changed upstream. Then the flow costs one hub call and ends in seconds with a
"no change" artifact: no download, no GPU time, no restart. When the revision points at a new
commit, deploy_model runs pinned to that commit, so what was checked is what gets deployed.
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
from prefect import flow, get_run_logger

from flows.deploy import deploy_model
from tasks.artifacts import (
    publish_nightly_deployed,
    publish_nightly_failed,
    publish_nightly_no_change,
    publish_nightly_unreachable,
)
from tasks.deployment.config import DeployConfig
from tasks.errors import HubUnreachable
from tasks.history.last_good import read_last_good, serving_deployment
from tasks.steps import hub_token, resolve_revision


@flow(name="nightly-refresh")
def nightly_refresh(config: DeployConfig) -> str:
    """Returns "no-change" or "deployed"; a failed deploy (a regression included) fails the run."""
    logger = get_run_logger()
    try:
        with hub_token(config.hf_token_secret):
            snapshot = resolve_revision(config.repo_id, config.revision, config.hub_endpoint)
    except HubUnreachable as err:
        publish_nightly_unreachable(config.repo_id, config.revision, err)
        raise
    last = read_last_good(config.run_dir)
    if last is not None and last.repo_id == config.repo_id and last.commit == snapshot.commit:
        publish_nightly_no_change(config.repo_id, config.revision, snapshot.commit, last.model_dir)
        logger.info("%s@%s is still %s: nothing to do", config.repo_id, config.revision, snapshot.commit[:12])
        return "no-change"
    was = f"`{last.repo_id}@{last.commit}`" if last else "nothing recorded"
    logger.info("%s@%s is now %s (last good: %s): deploying", config.repo_id, config.revision,
                snapshot.commit[:12], was)
    try:
        deploy_model(config.model_copy(update={"revision": snapshot.commit}))
    except Exception as err:
        serving = serving_deployment(config.run_dir)
        publish_nightly_failed(config.repo_id, config.revision, snapshot.commit, err,
                               f"{serving.repo_id}@{serving.commit}" if serving else None)
        raise
    publish_nightly_deployed(config.repo_id, config.revision, snapshot.commit, was)
    return "deployed"
