"""The compare flow: every benchmarked deployment the Prefect API remembers, side by side.

It reads the `history-<model>` artifacts that deploy runs publish, so it compares runs of any host
that reports to this Prefect server, and publishes the table where the runs themselves are read.
"""

# No `from __future__ import annotations`: Prefect builds the parameter form from real annotations.
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, Field

from tasks.errors import RegressionError
from tasks.history import comparison, read_history
from tasks.report import json_value


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
    threshold = config.threshold
    table = comparison(records, threshold)
    rows = [{k: json_value(v) for k, v in row.items()} for row in table.to_dict(orient="records")]
    create_table_artifact(key="run-comparison", table=rows,
                          description=f"{len(rows)} runs of {table['model'].nunique()} model(s)")
    newest = table.groupby("model").tail(1)
    regressed = newest[newest["regression"] != ""]
    lines = ["# Run comparison", "", f"{len(rows)} runs of {table['model'].nunique()} model(s); regression "
             f"threshold {threshold:.0%} against each model's previous good run.", ""]
    lines += [f"- **Regressed:** {r.model} at {r.revision}: {r.regression}" for r in regressed.itertuples()]
    lines += ["", table.drop(columns=["regression"]).to_markdown(index=False)]
    create_markdown_artifact(key="run-comparison-summary", markdown="\n".join(lines))
    logger.info("%d runs of %d model(s), %d newest run(s) regressed", len(rows), table["model"].nunique(),
                len(regressed))
    if config.fail_on_regression and not regressed.empty:
        raise RegressionError("; ".join(f"{r.model}: {r.regression}" for r in regressed.itertuples()))
    return rows
