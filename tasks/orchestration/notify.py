"""The events a person is told about, and the automations that tell them (deployments/automations.yaml).

A rollback is an event of its own, `rollout.deploy.rolled-back`, emitted by the deploy run: a failed
deploy run alone does not say whether the old model came back. A failed nightly is Prefect's own
flow-run event. The automations live on the Prefect server, so the notification goes out even when
the host that failed can no longer send anything.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from prefect.blocks.core import Block
from prefect.client.orchestration import get_client
from prefect.events import emit_event
from prefect.events.schemas.automations import AutomationCore
from prefect.runtime import flow_run

from tasks.errors import UnusableInput
from tasks.host import host_name
from tasks.names import model_slug
from tasks.orchestration.artifacts import ui_link

AUTOMATIONS = Path(__file__).resolve().parents[2] / "deployments" / "automations.yaml"
BLOCK_PLACEHOLDER = "NOTIFICATION_BLOCK"
ROLLED_BACK = "rollout.deploy.rolled-back"


def emit_rolled_back(repo_id: str, verdict: str) -> None:
    """Tell the Prefect server a deploy rolled back; the run's summary verdict is the message."""
    run_id = flow_run.get_id()
    emit_event(event=ROLLED_BACK,
               resource={"prefect.resource.id": f"rollout.model.{model_slug(repo_id)}",
                         "prefect.resource.name": repo_id},
               payload={"verdict": verdict, "host": host_name(),
                        "run_url": ui_link(f"runs/flow-run/{run_id}") if run_id else ""})


def install_automations(block: str, path: Path = AUTOMATIONS) -> list[str]:
    """Create the file's automations, each sending through the notification block `block`
    ("<block-type>/<block-name>", e.g. slack-webhook/ops); one of the same name is replaced."""
    try:
        block_id = Block.load(block)._block_document_id
    except (ValueError, KeyError) as err:
        raise UnusableInput(f"--block {block}: no such Prefect block ({err}); create it first "
                            "(README, Notifications)") from err
    text = path.read_text().replace(BLOCK_PLACEHOLDER, str(block_id))
    automations = [AutomationCore.model_validate(a) for a in yaml.safe_load(text)["automations"]]
    with get_client(sync_client=True) as client:
        for automation in automations:
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            client.create_automation(automation)
    return [a.name for a in automations]
