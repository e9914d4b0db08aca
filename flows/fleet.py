"""The fleet rollout: one revision onto many GPU hosts, canary first, through each host's own worker.

Prefect is the distributed engine: each host has its work pool and worker, and its deploy
deployment (generated from deployments/hosts.yaml). This flow only orders them. It pins the
revision to a commit once, runs the canary's deploy, then the rest in waves, and stops at the first
host that does not end serving: the hosts after it keep what they serve, and that host's own deploy
has already brought its last good model back. The hosts after the canary fetch from the canary's
mirror, so the Hub is read once per rollout.
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.errors import FleetRolloutFailed
from tasks.fleet.hosts import FleetConfig
from tasks.fleet.rollout import FleetReport, HostOutcome, fleet_rows, verdict
from tasks.fleet.router import HAProxy, RouterConfig, RouterReading, Traffic, rotation
from tasks.orchestration.artifacts import publish_fleet
from tasks.orchestration.run_labels import label_run
from tasks.orchestration.remote_steps import canary_on_live_traffic, deploy_on_host
from tasks.orchestration.steps import hub_token, resolve_revision


@task(name="read-router", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def read_router(router: RouterConfig) -> RouterReading:
    """The router's counters: read before the first wave and after the last, they are the clients' view."""
    return HAProxy(router).read()


@flow(name="fleet-rollout")
def fleet_rollout(config: FleetConfig) -> FleetReport:
    """Returns the report; a host that did not end serving fails the run after the artifact."""
    logger = get_run_logger()
    deploy = config.deploy
    label_run(deploy.repo_id, deploy.revision, prefix="fleet ")
    with hub_token(deploy.hf_token_secret):
        commit = resolve_revision(deploy.repo_id, deploy.revision, deploy.hub_endpoint).commit
    label_run(deploy.repo_id, deploy.revision, commit, prefix="fleet ")
    canary = config.hosts[0]
    if len(config.hosts) > 1 and not canary.mirror:
        logger.warning("the canary %s has no mirror: every host reads the Hub", canary.name)
    before = read_router(config.router) if config.router else None
    outcomes: list[HostOutcome] = []
    for wave, hosts in enumerate(config.waves(), start=1):
        mirror = canary.mirror if wave > 1 else None
        logger.info("wave %d: %s", wave, ", ".join(h.name for h in hosts))
        futures = [deploy_on_host.submit(host, wave, config.host_config(host, commit, mirror),
                                         pickup_deadline_s=config.pickup_deadline_s, router=config.router)
                   for host in hosts]
        outcomes += [future.result() for future in futures]
        if wave == 1 and outcomes[0].serving and config.router and config.router.canary_window_s and config.hosts[1:]:
            outcomes[0] = canary_on_live_traffic(config.router, outcomes[0], rest=config.hosts[1:],
                                                 what=f"{deploy.repo_id}@{commit[:12]}",
                                                 pickup_deadline_s=config.pickup_deadline_s)
        if not all(o.serving for o in outcomes):
            break
    after = read_router(config.router) if config.router else None
    report = FleetReport(
        deploy.repo_id, commit, verdict(deploy.repo_id, commit, config.hosts, outcomes=outcomes), outcomes,
        rows=fleet_rows(outcomes, config.hosts, slowdown=config.outlier_slowdown,
                        at_router={name: rotation(s) for name, s in after.servers.items()} if after else None),
        mirror=canary.mirror if len(config.hosts) > 1 else None,
        traffic=Traffic.between(before, after, frontend=bool(config.router.frontend)) if after else None)
    publish_fleet(report)
    logger.info(report.verdict)
    if not report.rolled_out:
        raise FleetRolloutFailed(report.verdict)
    return report
