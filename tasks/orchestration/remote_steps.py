"""The steps that run on other hosts: a host's own deployment run on its worker and waited for (a
fleet's deploy, the canary's rollback), and a multi-node group's secondary nodes joining or leaving.
Each is a Prefect task or a call the flows make; the domain stays in tasks.fleet."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun

from tasks.deployment.config import DeployConfig
from tasks.errors import HostUnreachable, ServerStartError, first_line
from tasks.fleet.canary import observe_canary
from tasks.fleet.hosts import FleetHost
from tasks.fleet.rollout import HostOutcome
from tasks.fleet.router import HAProxy, RouterConfig, rotation
from tasks.orchestration.history import read_deploy_outcome


# The fleet
def run_on_host(deployment: str, parameters: dict, pickup_deadline_s: float, *,
                tags: list[str] | None = None) -> FlowRun:
    """Run a host's deployment on its worker and wait until the run ends.

    A run that no worker has taken within `pickup_deadline_s` is cancelled: a host whose worker is
    down fails its step in minutes, where waiting for the run would hold the rollout forever.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Cancelled

    try:
        # A key of this call's own: when the Prefect server stalls (SQLite held for a minute under
        # load) and the client retries its request, the server returns the run it created instead of
        # a second one, which the deployment's concurrency limit cancelled, and which was followed.
        run = run_deployment(deployment, parameters=parameters, timeout=0, tags=tags,
                             idempotency_key=f"{deployment}:{uuid.uuid4()}")
    except ObjectNotFound as exc:
        raise HostUnreachable(f"no deployment {deployment}; add the host to deployments/hosts.yaml, run `rollout "
                              "deployments` and register them") from exc
    deadline = time.monotonic() + pickup_deadline_s
    with get_client(sync_client=True) as client:
        while not (run.state and run.state.is_final()):
            if run.state and run.state.is_scheduled() and time.monotonic() > deadline:
                said = f"no worker took it within {pickup_deadline_s:g} s"
                if client.set_flow_run_state(run.id, Cancelled(message=said)).status == SetStateStatus.ACCEPT:
                    pool = client.read_deployment(run.deployment_id).work_pool_name
                    raise HostUnreachable(f"{deployment}: {said}; is a worker polling work pool {pool} "
                                          f"(`prefect worker start --pool {pool}`)? Run {run.name} was cancelled")
            time.sleep(2)
            run = client.read_flow_run(run.id)
    return run


@task(name="deploy-on-host", task_run_name="deploy on {host.name}", cache_policy=NO_CACHE)
def deploy_on_host(host: FleetHost, wave: int, config: DeployConfig, *, pickup_deadline_s: float,
                   router: RouterConfig | None = None) -> HostOutcome:
    """Run the host's own deploy deployment on its work pool, wait for it, and read what it published.

    The child run is the host's whole deploy (fetch, validation, answer check, sweep, gate, rollback),
    run by that host's worker; this task only waits. Its failure is an outcome, not this task's.
    Behind a router the host is drained first and admitted after, whatever the deploy ended with: the
    router's health check then keeps a host that serves nothing out of rotation.
    """
    if router is None:
        return _deploy_on_host(host, wave, config, pickup_deadline_s=pickup_deadline_s)
    logger = get_run_logger()
    with HAProxy(router).out_of_rotation(host.name) as spell:
        logger.info("%s: drained at the router in %.1f s", host.name, spell.drained_s)
        outcome = _deploy_on_host(host, wave, config, pickup_deadline_s=pickup_deadline_s)
    logger.log(logging.INFO if spell.admitted.in_rotation else logging.ERROR, "%s: %s at the router", host.name,
               rotation(spell.admitted))
    return dataclasses.replace(outcome, drained_s=spell.drained_s)


@task(name="canary-on-live-traffic", task_run_name="{canary.host.name} on live traffic", cache_policy=NO_CACHE)
def canary_on_live_traffic(router: RouterConfig, canary: HostOutcome, *, rest: list[FleetHost], what: str,
                           pickup_deadline_s: float) -> HostOutcome:
    """The canary, checked and admitted, serves its share of live traffic for the router's window. A
    canary worse than the rest of the fleet is drained, rolled back by its host's own rollback
    deployment (the deployment before this one), and admitted again: the rollout then stops there."""
    logger = get_run_logger()
    name = canary.host.name
    judged = observe_canary(router, canary.host, rest)
    logger.log(logging.INFO if judged.passed else logging.ERROR, "%s on live traffic: %s", name, judged.summary())
    if judged.passed:
        return dataclasses.replace(canary, live=judged.summary())
    with HAProxy(router).out_of_rotation(name) as spell:
        try:
            run = run_on_host(f"rollback-model/{name}", {"target": {"models_root": str(canary.host.models_root)}},
                              pickup_deadline_s)
            back = ("the deployment before it serves again" if run.state and run.state.is_completed() else
                    f"its rollback ended {run.state.name if run.state else 'without a state'}: "
                    f"{(run.state.message or '') if run.state else ''}")
        except HostUnreachable as exc:
            back = f"its rollback could not run: {first_line(exc)}"
    return dataclasses.replace(canary, serving=False, live=judged.summary(), verdict=(
        f"Rolled back: {what} failed on live traffic: {judged.summary()}; {back}; {rotation(spell.admitted)}"))


def _deploy_on_host(host: FleetHost, wave: int, config: DeployConfig, *, pickup_deadline_s: float) -> HostOutcome:
    try:
        run = run_on_host(f"deploy-model/{host.name}", {"config": config.model_dump(mode="json")}, pickup_deadline_s,
                          tags=[f"fleet-wave:{wave}"])
    except HostUnreachable as exc:
        said = (f"Failed: {config.repo_id}@{config.revision[:12]} failed at {exc.stage}: {first_line(exc)}. "
                "It serves what it served")
        get_run_logger().error("%s: %s", host.name, said)
        return HostOutcome(host, wave, False, said)
    verdict, record, fetched = read_deploy_outcome(str(run.id), config.repo_id)
    state = run.state
    serving = bool(state and state.is_completed())
    sources = {s: sum(r.get("source") == s for r in fetched) for s in ("hub", "mirror", "cache")}
    get_run_logger().info("%s: %s", host.name, verdict or (state.name if state else "no state"))
    ended = f"Failed: run ended {state.name if state else 'unknown'}"
    return HostOutcome(host, wave, serving, verdict=verdict or ended,
                       flow_run_id=str(run.id), record=record, fetched=sources,
                       mirror_failures=[f"{r['file']}: {r['mirror_error']}" for r in fetched if r.get("mirror_error")])


# A multi-node group
@task(name="join-on-host", task_run_name="{action} on {host}", cache_policy=NO_CACHE)
def join_on_host(host: str, config: DeployConfig, action: str = "join") -> None:
    """Run the host's `join-group/<host>` deployment on its worker and wait for it: "join" starts
    vLLM headless there as its rank (fetching the model first), "leave" stops it. A worker gets the
    group's start-up deadline to take the run."""
    try:
        run = run_on_host(f"join-group/{host}", {"config": config.model_dump(mode="json"), "leave": action == "leave"},
                          config.startup_timeout_s)
    except HostUnreachable as exc:
        raise ServerStartError(f"secondary node {host}: {exc}", "group-incomplete", "") from exc
    if not (run.state and run.state.is_completed()):
        raise ServerStartError(f"secondary node {host} did not {action} the group: its run {run.name} ended "
                               f"{run.state.name if run.state else 'without a state'}: "
                               f"{(run.state.message or '') if run.state else ''}"[:400], "group-incomplete", "")
