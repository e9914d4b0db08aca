"""`rollout front start|stop|status`: the host's front door (tasks/fleet/front.py), started by the
operator once; HAProxy on the production port, the served vLLM behind it on a private one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import app, fail
from flows.cli.host import ModelsRoot
from tasks.errors import UnusableInput

front_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="The host's front door: HAProxy on the production port; a new server is checked on a "
                             "private port and admitted at promotion, and a swap holds requests instead of refusing "
                             "them.")
app.add_typer(front_app, name="front")


@front_app.command("start")
def start(*, models_root: ModelsRoot = Path("/models"),
          port: Annotated[int, typer.Option(min=1, max=65535, help="The production port clients use")] = 8000,
          host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 serves other machines")] = "127.0.0.1",
          hold_s: Annotated[float, typer.Option(min=0, help="How long a request waits while no server is admitted "
                                                            "(a swap), before a 503 with Retry-After")] = 300) -> None:
    """Start the front door on the production port (HAProxy, as a daemon that outlives this command)."""
    from tasks.fleet.front import start_front

    try:
        front = start_front(models_root / ".rollout", port=port, host=host, hold_s=hold_s)
    except UnusableInput as exc:
        fail(exc)
    typer.echo(f"front door at {front.url} (HAProxy pid {front.pid}): requests wait up to {front.hold_s:.0f} s "
               "until a server is admitted")


@front_app.command("stop")
def stop(models_root: ModelsRoot = Path("/models")) -> None:
    """Stop the front door: the production port closes (the vLLM behind it is not stopped)."""
    from tasks.fleet.front import stop_front

    try:
        stopped = stop_front(models_root / ".rollout")
    except UnusableInput as exc:
        fail(exc)
    typer.echo(f"stopped the front door on port {stopped.port} (HAProxy pid {stopped.pid})" if stopped
               else "no front door runs on this host")


@front_app.command("status")
def status(models_root: ModelsRoot = Path("/models")) -> None:
    """Where the front listens and which private port it sends clients to. Exit 0 with a server
    admitted, 3 none admitted (requests are held), 1 no front door runs."""
    from tasks.fleet.front import FrontDoor, read_front

    try:
        front = read_front(models_root / ".rollout")
        slots = FrontDoor(front).slots() if front else []
    except UnusableInput as exc:
        fail(exc)
    if front is None:
        typer.echo("no front door runs on this host: `rollout front start`")
        raise typer.Exit(1)
    serving = [slot for slot in slots if slot.serving]
    typer.echo(f"front door at {front.url} (HAProxy pid {front.pid})")
    for slot in slots:
        where = f"127.0.0.1:{slot.port}" if slot.port else "no server yet"
        typer.echo(f"  slot {slot.name}: {where}, {slot.stats.status}, {slot.stats.current} in flight")
    if not serving:
        typer.echo(f"no server admitted: requests wait up to {front.hold_s:.0f} s, then get a 503")
        raise typer.Exit(3)
