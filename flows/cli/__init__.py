"""The `rollout` command: demo, validate and deploy from a shell.

One module per kind of command, each registering on the one Typer app (`common.py`): `model.py`
(demo, validate, prepare, deploy, tune), `bench.py` (bench, history), `host.py` (the operator's
verbs), `fleet.py` (deployments, fleet, mirror), `front.py` (the host's front door). Options are
generated from the pydantic models (`options.py`). The commands import their stages when they run,
so `rollout --help` stays instant.
"""

# isort: off
# Each module registers its commands on the app; `rollout --help` lists them in this order.
from flows.cli import model  # noqa: F401
from flows.cli import bench  # noqa: F401
from flows.cli import host  # noqa: F401
from flows.cli import fleet  # noqa: F401
from flows.cli import front  # noqa: F401
# isort: on
from flows.cli.common import ANSWERS, ENGINE, FORM, LOAD, app

__all__ = ["ANSWERS", "ENGINE", "FORM", "LOAD", "app"]
