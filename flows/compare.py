"""The compare flow: every benchmarked deployment the Prefect API remembers, side by side.

It reads the `history-<model>` artifacts that deploy runs publish, so it compares runs of any host
that reports to this Prefect server, and publishes the table where the runs themselves are read.
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from tasks.errors import RegressionError
from tasks.history.runs import comparison, newest_regressed
from tasks.orchestration.artifacts import publish_comparison
from tasks.orchestration.history import read_history


class CompareConfig(BaseModel):
    models: list[str] = Field(default_factory=list, description="Repo ids; empty: every model")
    threshold: float = Field(0.1, ge=0, lt=1,
                             description="Fraction worse than the previous good run that counts as a regression")
    fail_on_regression: bool = Field(False, description="Fail the run when a model's newest run regressed")


@flow(name="compare-runs")
def compare_runs(config: CompareConfig) -> list[dict]:
    """The comparison table as artifacts; returns its rows."""
    logger = get_run_logger()
    records = [r for m in config.models for r in read_history(m)] if config.models else read_history()
    table = comparison(records, config.threshold)
    rows = publish_comparison(table, records, config.threshold)
    regressed = newest_regressed(table)
    logger.info("%d runs of %d model(s), %d newest run(s) regressed", len(rows), table["model"].nunique(),
                len(regressed))
    if config.fail_on_regression and not regressed.empty:
        raise RegressionError("; ".join(f"{r.model}: {r.regression}" for r in regressed.itertuples()))
    return rows
