"""The Prefect layer: every `@task` (steps), every artifact (artifacts), the host lock, run labels
and notifications. The domain packages beside it never import it (pyproject.toml's contracts)."""
