"""The nightly refresh: a full deploy only when the tracked revision moved on the hub.

Most nights nothing changed upstream. Then the flow costs one hub call and ends in seconds with a
"no change" artifact: no download, no GPU time, no restart. When the revision points at a new
commit, deploy_model runs pinned to that commit, so what was checked is what gets deployed.
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
from prefect import flow, get_run_logger

from flows.deploy import deploy_model
from tasks.deployment.config import DeployConfig
from tasks.errors import HubUnreachable, first_line
from tasks.history.last_good import read_last_good, serving_deployment
from tasks.orchestration.artifacts import publish_nightly
from tasks.orchestration.run_labels import child_run_id, label_run
from tasks.orchestration.steps import hub_token, resolve_revision
from tasks.vllm.process import serving_headless


@flow(name="nightly-refresh")
def nightly_refresh(config: DeployConfig) -> str:
    """Returns "no-change", "in-group" (a secondary node of a group led elsewhere) or "deployed"; a
    failed deploy (a regression included) fails the run."""
    logger = get_run_logger()
    repo, revision = config.repo_id, config.revision
    label_run(repo, revision, prefix="nightly ")  # findable even when the hub does not answer
    try:
        with hub_token(config.hf_token_secret):
            snapshot = resolve_revision(repo, revision, config.hub_endpoint)
    except HubUnreachable as err:
        publish_nightly(repo, revision, "Hub unreachable: nothing changed on this host",
                        body=f"**Hub unreachable:** {err}\n\nNothing was downloaded or restarted; what served keeps "
                        "serving.")
        raise
    commit = snapshot.commit
    label_run(repo, revision, commit, prefix="nightly ")
    last = read_last_good(config.run_dir)
    if last is not None and last.repo_id == repo and last.commit == commit:
        publish_nightly(repo, revision, f"No change: {revision} is still {commit[:12]}, the last good deployment",
                        body=f"**No change:** `{revision}` is still commit `{commit}`, the last good deployment on "
                        f"this host (`{last.model_dir}`). Nothing downloaded, nothing restarted.")
        logger.info("%s@%s is still %s: nothing to do", repo, revision, commit[:12])
        return "no-change"
    if serving_headless(config.run_dir / "server.json"):  # its GPUs belong to a group led from another host
        publish_nightly(repo, revision, "Skipped: this host serves as a secondary node of a multi-node group",
                        body=f"**Skipped:** `{revision}` is commit `{commit}`, but this host's GPUs run a secondary "
                        "node of a multi-node group led from another host; the leader's deploy moves the group.")
        logger.info("this host is a secondary node of a multi-node group: nothing to do here")
        return "in-group"
    was = f"`{last.repo_id}@{last.commit}`" if last else "nothing recorded"
    logger.info("%s@%s is now %s (last good: %s): deploying", repo, revision, commit[:12], was)
    try:
        deploy_model(config.model_copy(update={"revision": commit}))
    except Exception as err:
        serving = serving_deployment(config.run_dir)
        publish_nightly(repo, revision, f"Failed: {repo}@{commit[:12]} did not deploy: {first_line(err)}",
                        body=f"**Failed:** commit `{commit}` did not deploy: `{first_line(err)}`.\n\n"
                        + (f"**Serving:** the last good deployment, `{serving.repo_id}@{serving.commit}`." if serving
                           else "**Serving:** nothing on this host."), deploy_run_id=child_run_id())
        raise
    publish_nightly(repo, revision, f"Deployed: {repo}@{commit[:12]} serves",
                    body=f"**Deployed:** commit `{commit}` (last good before: {was}).", deploy_run_id=child_run_id())
    return "deployed"
