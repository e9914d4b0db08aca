"""Names, tags and links that make a flow run findable in the Prefect UI's Runs page.

A run is named for what it deploys (`tiny-moe@c9bc546 on gpu-box-1`) once the revision is pinned,
and tagged `model:<repo>`, `revision:<rev>`, `host:<name>` and `trigger:<nightly|ui|cli>`, so the
Runs page filters one model's history by a tag.
"""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.runtime import deployment, flow_run

from tasks.host import host_name
from tasks.names import model_slug

TRIGGER = "trigger:"


def model_tag(repo_id: str) -> str:
    return f"model:{repo_id}"


def _trigger() -> str:
    """nightly: the nightly flow or a run it started; ui: a run of a deployment (the UI's form, or its
    API); cli: a flow called from a shell (`rollout deploy`)."""
    parent = flow_run.get_parent_flow_run_id()
    if parent:
        with get_client(sync_client=True) as client:
            inherited = [t for t in client.read_flow_run(parent).tags if t.startswith(TRIGGER)]
        if inherited:
            return inherited[0].removeprefix(TRIGGER)
    if flow_run.get_flow_name() == "nightly-refresh":
        return "nightly"
    return "ui" if deployment.get_id() else "cli"


def label_run(repo_id: str, revision: str, commit: str | None = None, *, prefix: str = "") -> None:
    """Rename the current flow run for what it runs and add the tags; a no-op outside a flow run."""
    run_id = flow_run.get_id()
    if not run_id:
        return
    host = host_name()
    name = f"{prefix}{model_slug(repo_id.split('/')[-1])}@{(commit or revision)[:7]} on {host}"
    tags = [model_tag(repo_id), f"revision:{revision}", f"host:{host}", TRIGGER + _trigger()]
    current = list(flow_run.get_tags())
    with get_client(sync_client=True) as client:
        client.update_flow_run(run_id, name=name, tags=current + [t for t in tags if t not in current])


def child_run_id() -> str | None:
    """The newest flow run the current one started (the nightly's deploy), for a link to it."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    run_id = flow_run.get_id()
    if not run_id:
        return None
    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(
            any_=[run_id])), sort=FlowRunSort.START_TIME_DESC, limit=1)
    return str(children[0].id) if children else None
