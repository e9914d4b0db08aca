"""The fleet's one file, deployments/hosts.yaml: the model every host serves and one entry per host.

`rollout deployments` renders it into deployments/prefect.yaml, so adding a host is one entry
here, not a copied YAML block: each host gets its nightly, deploy, tune and join-group deployments
on its own work pool, with ROLLOUT_HOST set to its name; the fleet gets `fleet-rollout/fleet` and the report
`compare-runs/compare`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from tasks.deployment.config import DeployConfig
from tasks.errors import UnusableInput
from tasks.fleet.router import RouterConfig
from tasks.host import HOST_ENV
from tasks.vllm.settings import VllmSettings

PREFECT_VERSION = "3.7.0"


class FleetHost(BaseModel):
    """One GPU host: where its worker pulls runs from, where its models live, where it serves."""

    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9-]*$",
                      description="Its deployments are <flow>/<name>; its runs, history and deploy lock carry it")
    work_pool: str | None = Field(None, description="Its Prefect work pool; empty: the host's name")
    models_root: Path = Field(Path("/models"), description="Its filesystem for the HF cache")
    port: int = Field(8000, ge=1, le=65535, description="Where its vLLM serves")
    address: str | None = Field(None, description="Where the router reaches it; empty: its name")
    gpu_type: str = Field("", description="Its GPUs, e.g. 8x RTX PRO 6000 (SM120, 96 GB); hosts of a type are "
                                          "compared with each other")
    mirror: str | None = Field(None, description="URL of its `rollout mirror`: the hosts after it fetch there when "
                                                 "it is the canary")
    vllm: dict[str, Any] = Field(default_factory=dict, description="vLLM settings this host needs beyond the model's")

    @field_validator("vllm")
    @classmethod
    def _known_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        """A misspelt or out-of-range setting is refused with the form, not on the host mid-rollout."""
        unknown = sorted(set(value) - set(VllmSettings.model_fields))
        if unknown:
            raise ValueError(f"not vLLM settings: {', '.join(unknown)}")
        VllmSettings.model_validate(value)
        return value

    @property
    def pool(self) -> str:
        return self.work_pool or self.name


class FleetConfig(BaseModel):
    """A rollout: the model, the hosts in order (the first is the canary), and the wave size."""

    deploy: DeployConfig = Field(..., description="What to deploy; each host's models root, port and vLLM extras "
                                                  "replace the fields of the same name")
    hosts: list[FleetHost] = Field(..., min_length=1, description="In rollout order; the first is the canary")
    wave_size: int = Field(2, ge=1, description="Hosts deployed at once after the canary")
    outlier_slowdown: float = Field(0.2, gt=0, lt=1, description="A host this much slower than the median of its "
                                                                 "GPU type is flagged")
    pickup_deadline_s: float = Field(600, gt=0, description="A host's deploy run that no worker has taken by then is "
                                                            "cancelled and stops the rollout")
    router: RouterConfig | None = Field(None, description="The router in front of the hosts: each host is drained "
                                                          "there before its swap and admitted after")

    def waves(self) -> list[list[FleetHost]]:
        rest = self.hosts[1:]
        return [self.hosts[:1]] + [rest[i:i + self.wave_size] for i in range(0, len(rest), self.wave_size)]

    def host_config(self, host: FleetHost, revision: str, mirror: str | None = None) -> DeployConfig:
        """The deploy as this host runs it, pinned to `revision` (the commit the rollout resolved)."""
        vllm = VllmSettings.model_validate(self.deploy.vllm.model_dump(exclude_unset=True) | host.vllm)
        return self.deploy.model_copy(update={"revision": revision, "models_root": host.models_root,
                                              "port": host.port, "mirror_endpoint": mirror, "vllm": vllm})


class HostsFile(BaseModel):
    """deployments/hosts.yaml."""

    model: DeployConfig
    hosts: list[FleetHost] = Field(..., min_length=1)
    nightly_cron: str = "0 2 * * *"
    timezone: str = "Europe/Berlin"
    wave_size: int = Field(2, ge=1)
    fleet_pool: str | None = Field(None, description="Where the fleet rollout and the comparison run; empty: the "
                                                     "first host's pool")
    router: RouterConfig | None = Field(None, description="HAProxy in front of the hosts (its backend's servers are "
                                                          "named as the hosts)")

    @classmethod
    def read(cls, path: Path) -> HostsFile:
        """The file, or one line naming the file and the field that is wrong."""
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise UnusableInput(f"{path}: cannot read it ({exc.strerror})") from exc
        except yaml.YAMLError as exc:
            raise UnusableInput(f"{path}: not YAML ({str(exc).splitlines()[0]})") from exc
        try:
            hosts = cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise UnusableInput(f"{path}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from exc
        names = [h.name for h in hosts.hosts]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise UnusableInput(f"{path}: hosts: {', '.join(dup)} listed twice")
        return hosts

    def fleet(self, **changes) -> FleetConfig:
        router = {"router": self.router} if self.router else {}  # unset otherwise: prefect.yaml shows no null
        return FleetConfig(deploy=self.model, hosts=self.hosts, wave_size=self.wave_size, **router, **changes)

    def prefect_yaml(self) -> dict:
        """The deployments of every host and of the fleet, as `prefect deploy --all` reads them."""
        fleet_pool = {"name": self.fleet_pool or self.hosts[0].pool, "work_queue_name": "default"}
        deployments = []
        for host in self.hosts:
            config = self.fleet().host_config(host, self.model.revision).model_dump(mode="json", exclude_unset=True)
            config.pop("mirror_endpoint", None)
            common = {"work_pool": {"name": host.pool, "work_queue_name": "default",
                                    "job_variables": {"env": {HOST_ENV: host.name}}}}
            deployments += [
                {"name": host.name, "description": f"{host.name}: redeploy and benchmark only when the tracked "
                 "revision moved on the hub.", "entrypoint": "flows/nightly.py:nightly_refresh",
                 "tags": [host.name, "nightly"], **common,
                 "schedules": [{"cron": self.nightly_cron, "timezone": self.timezone}],
                 # A night that finds the host busy waits its turn rather than being dropped.
                 "concurrency_limit": {"limit": 1, "collision_strategy": "ENQUEUE"},
                 "parameters": {"config": config}},
                {"name": host.name, "description": f"{host.name}: deploy another model or other flags, from the "
                 "UI's run form; the fleet rollout runs it on each host.", "entrypoint": "flows/deploy.py:deploy_model",
                 "tags": [host.name, "ui"], **common,
                 # A second UI redeploy while one runs is cancelled at once, not queued behind it.
                 "concurrency_limit": {"limit": 1, "collision_strategy": "CANCEL_NEW"},
                 "parameters": {"config": config}},
                {"name": host.name, "description": f"{host.name}: find the best serving configuration by "
                 "measurement; with promote, the next deploy uses it.", "entrypoint": "flows/tune.py:tune_model",
                 "tags": [host.name, "ui"], **common,
                 "concurrency_limit": {"limit": 1, "collision_strategy": "CANCEL_NEW"},
                 "parameters": {"config": {"deploy": config, "promote": False}}},
                {"name": host.name, "description": f"{host.name}: roll back by hand to a good deployment, at its "
                 "own address: the last good one where it does not serve, else the one before it.",
                 "entrypoint": "flows/operate.py:rollback_model", "tags": [host.name, "ui"], **common,
                 "concurrency_limit": {"limit": 1, "collision_strategy": "CANCEL_NEW"},
                 "parameters": {"target": {"models_root": config.get("models_root", "/models")}}},
                {"name": host.name, "description": f"{host.name}: stop what it serves (rollback starts it again).",
                 "entrypoint": "flows/operate.py:stop_model", "tags": [host.name, "ui"], **common,
                 "concurrency_limit": {"limit": 1, "collision_strategy": "CANCEL_NEW"},
                 "parameters": {"target": {"models_root": config.get("models_root", "/models")}}},
                {"name": host.name, "description": f"{host.name} as a secondary node of a model larger than one "
                 "box: vLLM headless as its rank, started and stopped by the leader's deploy.",
                 "entrypoint": "flows/group.py:join_group", "tags": [host.name, "group"], **common,
                 "parameters": {"config": config, "leave": False}},
            ]
        deployments += [
            {"name": "fleet", "description": "Roll a revision out over the hosts: the canary first, then waves; the "
             "first host that fails stops it.", "entrypoint": "flows/fleet.py:fleet_rollout", "tags": ["fleet", "ui"],
             "work_pool": fleet_pool, "concurrency_limit": {"limit": 1, "collision_strategy": "CANCEL_NEW"},
             "parameters": {"config": self.fleet().model_dump(mode="json", exclude_unset=True)}},
            {"name": "compare", "description": "Every benchmarked deployment side by side, with regressions against "
             "the previous good run.", "entrypoint": "flows/compare.py:compare_runs", "tags": ["report"],
             "work_pool": fleet_pool, "parameters": {"config": {"models": [], "threshold": 0.1}}},
        ]
        return {"name": "rollout", "prefect-version": PREFECT_VERSION,
                # Workers run the flows from this checkout (the worker image installs it at /opt/rollout).
                "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $ROLLOUT_HOME }}"}}],
                "deployments": deployments}


HEADER = """\
# GENERATED from deployments/hosts.yaml by `rollout deployments`: edit that file, then run it again.
# Register from the repository root:
#   ROLLOUT_HOME=$PWD prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml
# and on each host start its worker:  prefect worker start --pool <its work_pool>
"""


class _Plain(yaml.SafeDumper):
    """Every block written out: a reader of prefect.yaml sees each host's values, not &id001."""

    def ignore_aliases(self, data) -> bool:
        return True


def render(hosts: HostsFile) -> str:
    return HEADER + yaml.dump(hosts.prefect_yaml(), Dumper=_Plain, sort_keys=False, width=120)
