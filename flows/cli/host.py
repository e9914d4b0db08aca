"""The host operator's verbs: `rollout notify`, `status`, `stop`, `rollback`, `recover` and `logs`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flows.cli.common import (
    app,
    check_prefect,
    exit_on_sigterm,
    fail,
)
from tasks.errors import UnusableInput

if TYPE_CHECKING:
    pass


@app.command()
def notify(
    block: Annotated[str, typer.Option(help="The Prefect notification block to send through, as "
                                            "<block-type>/<block-name>, e.g. slack-webhook/ops")],
) -> None:
    """Install the automations of deployments/automations.yaml on the Prefect server: a message
    when a deploy rolls back or the nightly fails."""
    from tasks.orchestration.notify import install_automations

    if block.count("/") != 1 or not all(block.split("/")):
        typer.echo(f"error: --block {block!r}: expected <block-type>/<block-name>, e.g. slack-webhook/ops", err=True)
        raise typer.Exit(2)
    try:
        names = install_automations(block)
    except UnusableInput as exc:
        fail(exc)
    for name in names:
        typer.echo(f"automation {name!r}: notifies through {block}")


ModelsRoot = Annotated[Path, typer.Option(help="The host's models root (its state is in models_root/.rollout)")]


@app.command()
def status(models_root: ModelsRoot = Path("/models"),
           as_json: Annotated[bool, typer.Option("--json", help="Print the records as JSON")] = False) -> None:
    """What this host serves: model, commit, since when, URL, whether its process group lives and
    answers, the last benchmark and answer check, the tuned settings in use.

    Exit 0 serving, 3 nothing serves, 1 the recorded server is dead or does not answer.
    """
    from dataclasses import replace

    from tasks.fleet.front import front_status
    from tasks.history.serving import host_status

    try:
        found = host_status(models_root / ".rollout")
        front, front_down = front_status(models_root / ".rollout")
    except UnusableInput as exc:
        fail(exc)
    found = replace(found, front=front, front_down=front_down)
    if as_json:
        typer.echo(json.dumps({"exit_code": found.exit_code, "server": found.state, "alive_pgid": found.alive_pgid,
                               "models": found.answers, "unfinished_swap": found.unfinished_swap,
                               "rollback_to": back.what if (back := found.rollback_target()) else None,
                               "last_good": found.last_good.model_dump(mode="json") if found.last_good else None},
                              indent=2))
    else:
        typer.echo("\n".join(found.lines()))
    raise typer.Exit(found.exit_code)


@app.command()
def stop(models_root: ModelsRoot = Path("/models")) -> None:
    """Stop the host's vLLM server (the stop-model flow, in the run history); `rollout rollback`
    starts the last good deployment again."""
    from flows.operate import HostTarget, stop_model

    exit_on_sigterm()
    check_prefect()
    try:
        pgid = stop_model(HostTarget(models_root=models_root))
    except Exception as exc:
        fail(exc, run_dir=models_root / ".rollout")
    typer.echo(f"stopped vLLM process group {pgid}; nothing serves on this host" if pgid
               else "nothing was running on this host")


@app.command()
def rollback(models_root: ModelsRoot = Path("/models"),
             startup_timeout_s: Annotated[float, typer.Option(help="Load deadline, seconds")] = 1800) -> None:
    """Bring a good deployment back at its own address (the rollback-model flow): the last good one
    where it does not serve; where it does, the good one before it."""
    from flows.operate import HostTarget, rollback_model

    exit_on_sigterm()
    check_prefect()
    try:
        now = rollback_model(HostTarget(models_root=models_root, startup_timeout_s=startup_timeout_s))
    except Exception as exc:
        fail(exc, run_dir=models_root / ".rollout")
    typer.echo(f"serving {now}")


@app.command()
def recover(models_root: ModelsRoot = Path("/models"),
            startup_timeout_s: Annotated[float, typer.Option(help="Load deadline, seconds")] = 1800) -> None:
    """Finish a swap whose deploy died: the last good deployment serving again, or nothing done
    where it serves. A swap's guard runs it by itself; exit 0 when the last good one serves."""
    from flows.operate import HostTarget, rollback_model

    exit_on_sigterm()
    check_prefect()
    try:
        now = rollback_model(HostTarget(models_root=models_root, startup_timeout_s=startup_timeout_s), recover=True)
    except Exception as exc:
        fail(exc, run_dir=models_root / ".rollout")
    typer.echo(f"serving {now}")


@app.command()
def logs(models_root: ModelsRoot = Path("/models"),
         lines: Annotated[int, typer.Option("--lines", "-n", help="How many of the last lines")] = 60) -> None:
    """The tail of the host's vLLM log (the server serving now, or the last one started)."""
    from tasks.vllm.log import log_tail

    run_dir = models_root / ".rollout"
    try:
        recorded = Path(json.loads((run_dir / "server.json").read_text())["log_path"])
    except (OSError, ValueError, KeyError, TypeError):
        recorded = run_dir / "vllm.log"
    if not recorded.is_file():
        typer.echo(f"error: --models-root {models_root}: no vLLM log at {recorded}", err=True)
        raise typer.Exit(2)
    typer.echo(log_tail(recorded, lines))
