"""The run history read back from the Prefect API: every deploy's record (`history-<model>`
artifacts), a deploy run's outcome as it published it, and a run's other artifacts. Through the
Prefect client, so it works against any server the flows report to, and what an engineer sees in
the UI is what `rollout history` prints."""

from __future__ import annotations

import json

from tasks.history.runs import RunRecord
from tasks.names import model_slug

HISTORY = "history-"
PAGE = 200  # the API's default page limit


def read_history(model: str | None = None) -> list[RunRecord]:
    """Every record the Prefect API holds, oldest first; one model's when `model` is given.

    Through the Prefect client, page by page, so it works against any server the flows report to,
    and what an engineer sees in the UI is what `rollout history` prints.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        ArtifactFilterType,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    key = ArtifactFilterKey(any_=[HISTORY + model_slug(model)]) if model else ArtifactFilterKey(like_=HISTORY)
    wanted = ArtifactFilter(key=key, type=ArtifactFilterType(any_=["table"]))
    # Keyed by what the record is, not by artifact id: a record published while we page shifts later
    # pages by one, and a create the client retried (the server stored the first try but timed out
    # answering, as SQLite under load does) stores the same record twice.
    seen: dict[tuple, RunRecord] = {}
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_artifacts(artifact_filter=wanted, sort=ArtifactSort.CREATED_DESC, limit=PAGE,
                                         offset=offset)
            for artifact in page:
                if artifact.key and artifact.key.startswith(HISTORY):  # like_ matches anywhere in the key
                    data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
                    for record in (RunRecord.model_validate(row) for row in data):
                        seen[(record.model, record.commit, record.time, record.host)] = record
            if len(page) < PAGE:
                return sorted(seen.values(), key=lambda r: r.time)
            offset += PAGE


def read_deploy_outcome(flow_run_id: str, repo_id: str) -> tuple[str | None, RunRecord | None, list[dict]]:
    """A deploy run's summary verdict, history record and fetch table, as it published them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    slug = model_slug(repo_id)
    with get_client(sync_client=True) as client:
        found = {a.key: a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))}

    def rows(key: str) -> list[dict]:
        data = found[key].data if key in found else "[]"
        return json.loads(data) if isinstance(data, str) else data

    summary = found.get(f"deploy-{slug}")
    records = [RunRecord.model_validate(row) for row in rows(HISTORY + slug)]
    return (summary.description if summary else None, records[-1] if records else None,
            [r for r in rows(f"fetch-{slug}") if not r["file"].startswith("(")])
