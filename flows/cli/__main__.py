"""`python -m flows.cli`: the `rollout` command."""

from flows.cli import app

app()
