"""Benchmark results as a table and a summary in the Prefect UI, keyed per model for history."""

from __future__ import annotations

import math
import re

import pandas as pd
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

SUMMARY_COLUMNS = [
    "concurrency", "completed", "failed", "output_throughput", "total_token_throughput",
    "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "itl_p99_ms", "e2el_p99_ms",
]


def model_slug(repo_id: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9]+", "-", repo_id.lower())).strip("-")


def bench_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows).sort_values("concurrency").reset_index(drop=True)


def _plain(value):
    """Artifacts are JSON: numpy scalars and NaN are not."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def summary_markdown(df: pd.DataFrame, title: str, facts: dict[str, str]) -> str:
    best = df.loc[df["output_throughput"].idxmax()]
    single = df[df["concurrency"] == 1]
    lines = [f"# {title}", ""]
    lines += [f"- **{k}:** {v}" for k, v in facts.items()]
    if not single.empty:
        lines.append(f"- **Single stream:** {single['output_throughput'].iloc[0]:.1f} output tok/s")
    lines.append(f"- **Peak (knee):** {best['output_throughput']:.1f} output tok/s at concurrency "
                 f"{int(best['concurrency'])}")
    lines += ["", df[SUMMARY_COLUMNS].round(2).to_markdown(index=False)]
    return "\n".join(lines)


@task(name="publish-results", tags=["report"])
def publish_results(rows: list[dict], repo_id: str, facts: dict[str, str]) -> pd.DataFrame:
    df = bench_table(rows)
    slug = model_slug(repo_id)
    create_table_artifact(
        key=f"bench-{slug}",
        table=[{k: _plain(v) for k, v in row.items()} for row in df.to_dict(orient="records")],
        description=f"Concurrency sweep of {repo_id}",
    )
    create_markdown_artifact(
        key=f"bench-summary-{slug}",
        markdown=summary_markdown(df, f"Benchmark of {repo_id}", facts),
        description=f"Benchmark summary of {repo_id}",
    )
    return df
