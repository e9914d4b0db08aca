"""Benchmark results as files beside the run and as Prefect artifacts, keyed per model for history."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tasks.bench.results import LevelResult
from tasks.bench.sweep import knee

SUMMARY_COLUMNS = [
    "concurrency", "completed", "failed", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "flags",
]


def bench_table(results: list[LevelResult]) -> pd.DataFrame:
    return pd.DataFrame([r.model_dump() for r in results]).sort_values("concurrency").reset_index(drop=True)


def write_chart(df: pd.DataFrame, path: Path, title: str) -> Path | None:
    """Throughput and p99 latencies against concurrency: where the curve bends is the knee. A level
    where every request failed has no figures to draw; with no other level there is no chart."""
    df = df[df["completed"] > 0]
    if df.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU host or in CI
    import matplotlib.pyplot as plt

    fig, (tput, lat) = plt.subplots(1, 2, figsize=(11, 4))
    tput.plot(df["concurrency"], df["output_throughput"], marker="o", label="output tok/s")
    tput.plot(df["concurrency"], df["total_token_throughput"], marker=".", linestyle="--", label="total tok/s")
    tput.set(xlabel="concurrency", ylabel="tokens/s", xscale="log", title="Throughput")
    tput.legend()
    for column, label in (("p99_ttft_ms", "p99 TTFT"), ("p99_tpot_ms", "p99 TPOT"), ("p99_e2el_ms", "p99 E2E")):
        lat.plot(df["concurrency"], df[column], marker="o", label=label)
    lat.set(xlabel="concurrency", ylabel="ms", xscale="log", yscale="log", title="p99 latency")
    lat.legend()
    for axis in (tput, lat):
        axis.set_xticks(df["concurrency"], [str(c) for c in df["concurrency"]])
        axis.set_xticks([], minor=True)  # the log scale's minor labels ("3x10^0") would sit among the levels
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_markdown(results: list[LevelResult], df: pd.DataFrame, title: str, facts: dict[str, str],
                     stop: str | None = None, chart: Path | None = None) -> str:
    best = knee(results)
    single = next((r for r in results if r.concurrency == 1), None)
    lines = [f"# {title}", ""]
    lines += [f"- **{k}:** {v}" for k, v in facts.items()]
    if single is not None:
        lines.append(f"- **Single stream:** {single.output_throughput:.1f} output tok/s")
    if best is not None:
        lines.append(f"- **Peak (knee):** {best.output_throughput:.1f} output tok/s at concurrency {best.concurrency}")
    else:
        lines.append("- **Peak (knee):** none: no level met the SLO")
    lines.append(f"- **Sweep ended:** {stop or 'after the last level'}")
    flagged = df[df["flags"] != ""]
    for _, row in flagged.iterrows():
        lines.append(f"- **Concurrency {int(row['concurrency'])}:** {row['flags']}")
    if chart is not None:
        lines.append(f"- **Chart:** [{chart.name}]({chart.as_uri()}) (results in `{chart.parent}`)")
    lines += ["", df[SUMMARY_COLUMNS].round(2).to_markdown(index=False)]
    return "\n".join(lines)


def save_results(results: list[LevelResult], results_dir: Path, title: str, facts: dict[str, str],
                 stop: str | None) -> tuple[pd.DataFrame, str]:
    """results.csv, chart.png and summary.md next to the per-level JSON files."""
    df = bench_table(results)
    results_dir.mkdir(parents=True, exist_ok=True)
    df.to_csv(results_dir / "results.csv", index=False)
    chart = write_chart(df, results_dir / "chart.png", title)
    markdown = summary_markdown(results, df, title, facts, stop, chart)
    (results_dir / "summary.md").write_text(markdown + "\n")
    return df, markdown
