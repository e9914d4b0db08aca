"""The operator's flows: stop what the host serves, and roll back by hand. Both take the host lock,
so neither collides with a deploy, and both are runs in Prefect's history (`rollout stop`,
`rollout rollback`, or the host's stop-model and rollback-model deployments from the UI).
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from flows.restore import restore_last_good
from tasks.errors import ServerStartError, UnusableInput
from tasks.history.last_good import (
    LastGood,
    read_last_good,
    read_previous_good,
    swap_to_previous,
    write_last_good,
)
from tasks.history.serving import check_state_files
from tasks.history.swap import abandoned_swap, begin_swap, end_swap
from tasks.orchestration.artifacts import publish_stopped
from tasks.orchestration.host_lock import host_lock, mark_crashed
from tasks.orchestration.steps import secret, stop_serving
from tasks.vllm.gap import GapProbe
from tasks.vllm.process import serving_group


class HostTarget(BaseModel):
    """Which host's server: the one whose state lives under models_root/.rollout."""

    models_root: Path = Field(Path("/models"), description="Filesystem that holds the HF cache and .rollout")
    startup_timeout_s: float = Field(1800, gt=0, description="Load deadline for the server a rollback starts")

    @property
    def run_dir(self) -> Path:
        return self.models_root / ".rollout"


def _what(record: LastGood | None) -> str:
    return record.what if record else "an unrecorded server"


@flow(name="stop-model")
def stop_model(target: HostTarget) -> int | None:
    """Stop the host's vLLM server; the last good record stays, so `rollback` can start it again.
    Returns the stopped process group, None when nothing ran."""
    with host_lock(run_dir=target.run_dir):
        check_state_files(target.run_dir)
        last = read_last_good(target.run_dir)
        pgid = serving_group(target.run_dir / "server.json")
        what = _what(last if last and last.serving_pgid == pgid else None)
        if pgid is not None:
            stop_serving(target.run_dir, what)
        if last is not None and last.serving_pgid is not None:
            write_last_good(target.run_dir, last.model_copy(update={"serving_pgid": None}))
        publish_stopped(last.repo_id if last else "host", what, pgid)
        get_run_logger().info("stopped %s (process group %s)" % (what, pgid) if pgid else "nothing was running")
    return pgid


@flow(name="rollback-model")
def rollback_model(target: HostTarget, recover: bool = False) -> str:
    """Bring a good deployment back at its own address: the last good one where it does not serve
    (stopped, dead, or replaced by a deploy that never finished); the one before it where the last
    good one serves, unless `recover` (what a swap's guard runs after its deploy died: the last good
    one back, or nothing done). Returns what serves now."""
    run_dir = target.run_dir
    with host_lock(run_dir=run_dir):
        check_state_files(run_dir)
        if recover and (crashed := mark_crashed(abandoned_swap(run_dir))) is not None:
            get_run_logger().warning("flow run %s died mid-swap; marked Crashed", crashed)
        last = read_last_good(run_dir)
        if last is None or last.server is None:
            raise UnusableInput(f"no good deployment to roll back to: {run_dir / 'last-good.json'} records none")
        serving = serving_group(run_dir / "server.json")
        if recover and serving is not None and serving == last.serving_pgid:
            return f"{_what(last)} (already serving)"
        if serving is not None and serving == last.serving_pgid:
            target_record = read_previous_good(run_dir)
            if target_record is None:
                raise UnusableInput(f"{_what(last)} serves, and no good deployment before it is recorded "
                                    f"({run_dir / 'previous-good.json'})")
            why = f"rolled back by hand from {_what(last)}"
        else:
            target_record, why = last, ("recovered after a deploy died mid-swap: " if recover else
                                        "started again by hand: ") + (
                "nothing served" if serving is None else "the server running was not the last good deployment")
        if not target_record.model_dir.is_dir():
            raise UnusableInput(f"{_what(target_record)}: its files are gone from {target_record.model_dir}")
        begin_swap(run_dir, what=f"rollback to {_what(target_record)}", models_root=target.models_root,
                   flow_run_id=str(flow_run.get_id() or "") or None)
        # A client's view, where a server answered before: the rollback's own gap.
        with GapProbe(run_dir / "server.json", api_key=secret(target_record.api_key_secret)) as probe:
            try:
                if serving is not None:
                    probe.wait_for_answer(serving)  # the old server's last answer is the gap's start
                    stop_serving(run_dir, "the server rolled back from")
                if target_record is not last:
                    swap_to_previous(run_dir)
                now, failed = restore_last_good(target_record, run_dir=run_dir,
                                                startup_timeout_s=target.startup_timeout_s, why=why)
            finally:
                end_swap(run_dir)
            if serving is not None and not failed and (restored := read_last_good(run_dir)) is not None:
                probe.wait_for_answer(restored.serving_pgid)
                gap = probe.gap(old_pgid=serving, new_pgid=restored.serving_pgid)
                get_run_logger().warning("unavailable during the rollback: %s", gap.text())
                now += f" (unavailable {gap.seconds:.1f} s)" if gap.seconds is not None else ""
        if failed:
            raise ServerStartError(f"rollback to {_what(target_record)} failed: {now}. Nothing serves on this host",
                                   "rollback-failed", "")
    return now
