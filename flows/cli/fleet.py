"""`rollout deployments`, `fleet` and `mirror`: the hosts file, a rollout over the hosts, and a host's
cache for the hosts after it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from pydantic import ValidationError

from flows.cli.common import (
    app,
    check_hub,
    check_prefect,
    exit_on_sigterm,
    fail,
)
from tasks.errors import UnusableInput

if TYPE_CHECKING:
    pass


HostsPath = Annotated[Path, typer.Option("--hosts", help="The fleet's hosts file")]
HOSTS_FILE = Path("deployments/hosts.yaml")


def _hosts(path: Path):
    from tasks.fleet.hosts import HostsFile

    try:
        return HostsFile.read(path)
    except UnusableInput as exc:
        fail(exc)


@app.command()
def deployments(
    hosts: HostsPath = HOSTS_FILE,
    out: Annotated[Path, typer.Option(help="The prefect.yaml to write")] = Path("deployments/prefect.yaml"),
    check: Annotated[bool, typer.Option(help="Write nothing; exit 1 when OUT is not what HOSTS renders to")] = False,
) -> None:
    """Render the hosts file into the Prefect deployments of every host and of the fleet."""
    from tasks.fleet.hosts import render

    text = render(_hosts(hosts))
    if check:
        same = out.exists() and out.read_text() == text
        typer.echo(f"{out} {'matches' if same else 'is out of date with'} {hosts}")
        raise typer.Exit(0 if same else 1)
    out.write_text(text)
    typer.echo(f"wrote {out}: the deployments of {len(_hosts(hosts).hosts)} host(s) and the fleet")


@app.command()
def fleet(
    hosts: HostsPath = HOSTS_FILE,
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit; default: the hosts file's")] = None,
    wave_size: Annotated[Optional[int], typer.Option(help="Hosts deployed at once after the canary")] = None,
) -> None:
    """Roll the hosts file's model out over its hosts (the fleet-rollout flow, run here): the canary
    first, then waves, each host deployed by its own worker; the first host that fails stops it."""
    from prefect.settings import PREFECT_API_URL

    from flows.fleet import fleet_rollout

    if not PREFECT_API_URL.value():
        typer.echo("error: rollout fleet runs each host's deploy through its worker: set PREFECT_API_URL to the "
                   "Prefect server the workers poll", err=True)
        raise typer.Exit(2)
    spec = _hosts(hosts)
    changes = {"revision": revision} if revision else {}
    try:
        config = spec.fleet(**({"wave_size": wave_size} if wave_size else {}))
        config = config.model_copy(update={"deploy": config.deploy.model_copy(update=changes)})
    except ValidationError as exc:
        err = exc.errors()[0]
        typer.echo(f"error: bad option --{str(err['loc'][0]).replace('_', '-')}: {err['msg']}", err=True)
        raise typer.Exit(2)
    if config.router:  # a router that does not answer, or lacks a host, fails here, not mid-rollout
        from tasks.fleet.router import HAProxy

        try:
            at_router = HAProxy(config.router)
            for host in config.hosts:
                at_router.server(host.name)
        except UnusableInput as exc:
            fail(UnusableInput(f"{hosts}: router: {exc}"))
    check_hub(config.deploy.repo_id, config.deploy.revision, config.deploy.hub_endpoint)
    exit_on_sigterm()
    check_prefect()
    try:
        report = fleet_rollout(config)
    except Exception as exc:
        fail(exc)
    import pandas as pd

    rows = [{k: v for k, v in row.items() if k not in ("flow_run_id", "failures", "verdict")} for row in report.rows]
    with pd.option_context("display.width", 250, "display.max_columns", None):
        typer.echo(pd.DataFrame(rows).to_string(index=False, na_rep="-"))
    for line in report.traffic_lines():
        typer.echo(line.replace("**", "").removeprefix("- "))


@app.command()
def mirror(
    models_root: Annotated[Path, typer.Option(help="The host's models root; its HF cache is models_root/hub")
                           ] = Path("/models"),
    host: Annotated[str, typer.Option(help="Address to listen on; beyond loopback (0.0.0.0 serves the other "
                                           "hosts) it asks for ROLLOUT_MIRROR_TOKEN")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8090,
    *, anonymous: Annotated[bool, typer.Option(help="Serve beyond loopback without a token: anyone who reaches the "
                                                 "address reads every model in the cache, gated ones included")
                         ] = False,
) -> None:
    """Serve this host's verified HF cache read-only over the Hub's file route, for the hosts after it
    in a fleet rollout (their `mirror_endpoint`). Runs until stopped. Where ROLLOUT_MIRROR_TOKEN is
    set (the same on every host), every file request must present it; beyond loopback it must be set,
    or --anonymous given (docs/security.md)."""
    from tasks.hub import MIRROR_TOKEN_ENV
    from tasks.mirror import CacheMirror, exposure
    from tasks.trust import env_secret

    cache = models_root / "hub"
    if not models_root.is_dir():
        typer.echo(f"error: --models-root {models_root}: no such folder", err=True)
        raise typer.Exit(2)
    token = env_secret(MIRROR_TOKEN_ENV)
    try:
        to_whom = exposure(host, port, token=token, anonymous=anonymous)
    except UnusableInput as exc:
        fail(exc)
    cache.mkdir(exist_ok=True)  # a fresh host's cache: it serves what its deploys fetch from now on
    exit_on_sigterm()
    try:
        served = CacheMirror(cache, host, port, log=lambda line: typer.echo(line), token=token)
    except OSError as exc:
        typer.echo(f"error: --port {port}: cannot listen on {host}:{port} ({exc.strerror})", err=True)
        raise typer.Exit(2)
    commits = served.served()
    typer.echo(f"mirror of {cache} at {served.endpoint}: {len(commits)} verified commit(s) "
               f"({', '.join(commits[:3])}{', ...' if len(commits) > 3 else ''}), read-only, {to_whom}", err=True)
    try:
        served.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        served.server.server_close()
