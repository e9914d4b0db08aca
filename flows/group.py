"""A secondary node of a model larger than one box: its share of the engine's ranks, headless.

The leader's deploy (flows/deploy.py) runs this on each follower host, through that host's
`join-group/<host>` deployment and worker, before it starts its own API server; vLLM's leader
then waits for every rank, and its readiness checks that it reports them all.
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
from prefect import flow, get_run_logger

from flows.prepare import prepare_steps
from tasks.deployment.config import DeployConfig
from tasks.deployment.stages import server_config
from tasks.history.last_good import serving_deployment
from tasks.orchestration.host_lock import host_lock
from tasks.orchestration.steps import probe_gpus, start_vllm, stop_serving
from tasks.vllm.command import warming_option_table


@flow(name="join-group")
def join_group(config: DeployConfig, leave: bool = False) -> str:
    """Fetch and check the model while this host still serves what it served, then stop that and
    start vLLM headless as the rank in `config.vllm`; with `leave`, only stop it. The host lock is
    held: a nightly or a redeploy of this host waits, rather than taking the GPUs from the group."""
    logger = get_run_logger()
    with host_lock(run_dir=config.run_dir):
        if not leave:
            with warming_option_table(config.run_dir):
                prepared = prepare_steps(config, run_prefix="join ")
            gpu = probe_gpus()
        previous = serving_deployment(config.run_dir)
        stop_serving(config.run_dir, previous.what if previous else "what runs")
        if leave:
            logger.info("left the group: nothing of it runs on this host")
            return "left"
        server = server_config(config, prepared.model_dir, gpu.platform).model_copy(update={"headless": True})
        handle, _ = start_vllm(server, config.run_dir, config.startup_timeout_s, api_key_secret=None,
                               repo_id=config.repo_id)
        logger.info("ranks launched in %.0f s; the leader at %s waits for them", handle.startup_s,
                    config.vllm.master_addr or config.vllm.data_parallel_address)
    return "joined"
