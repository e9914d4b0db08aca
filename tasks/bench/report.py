"""Benchmark results as files beside the run and as Prefect artifacts, keyed per model for history."""

from __future__ import annotations

import base64
from pathlib import Path

import pandas as pd

from tasks.bench.results import Latency, LevelResult
from tasks.bench.sweep import knee, single_stream

# Why a level carries each flag, in the words the summary prints once per flag.
FLAG_MEANINGS = {
    "client-limited": "the benchmark client, not the server, set the pace: its event loop woke late (p99 lag over "
                      "max_loop_lag_ms) or it used over 90% of a core, so every timestamp is late",
    "queued": "requests waited in vLLM's queue: the server ran fewer at once than were sent",
    "kv-cache-full": "vLLM's KV cache was full: it preempts or queues requests",
    "all-failed": "every request failed",
    "failures": "some requests failed (see errors)",
    "slo-missed": "fewer requests than slo_attainment met the SLO",
    "no-steady-state": "the level was too short for a measurement window (all its requests were sent at once), so "
                       "its figures include the fill and the drain: raise level_duration_s or requests_per_level",
}


def markdown_table(df: pd.DataFrame) -> str:
    """A table for a markdown artifact: a missing value is a dash, not `nan`."""
    return df.astype(object).where(df.notna(), None).to_markdown(index=False, missingval="-")


def png_data_uri(png: bytes) -> str:
    """An image the Prefect UI shows: its markdown renderer loads `data:` images (checked in Chromium),
    while a file:// link is refused and inline SVG renders black."""
    return "data:image/png;base64," + base64.b64encode(png).decode()


def bench_table(results: list[LevelResult]) -> pd.DataFrame:
    """Every figure of every level in vLLM's key names: the CSV and the full artifact."""
    return pd.DataFrame([r.model_dump() for r in results]).sort_values("concurrency").reset_index(drop=True)


def with_interval(value: float | None, ci: tuple[float, float] | None, digits: int = 1) -> str:
    """A figure as a reader takes it in: "2,276.0 ±95.3", the 95% interval's half-width after ±."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" + (f" ±{(ci[1] - ci[0]) / 2:,.{digits}f}" if ci else "")


def _p99(latency: Latency) -> str:
    """A p99 over too few values is not one: the maximum is shown, and says so."""
    if latency.p99 is not None:
        return f"{latency.p99:.1f}"
    return f"max {latency.max:.1f} (n={latency.samples})" if latency.max is not None else "-"


def headline_table(results: list[LevelResult]) -> pd.DataFrame:
    """The figures a reader decides by, with their 95% intervals (± half-width), units in the headers."""
    rows = []
    for r in sorted(results, key=lambda r: r.concurrency):
        rows.append({
            "concurrency": r.concurrency,
            "measured": f"{r.measured}/{r.requests}",
            "window s": f"{r.window:.1f}",
            "output tok/s": with_interval(r.output_throughput, r.output_throughput_ci, 1),
            "TTFT median ms": with_interval(r.ttft.median, r.ttft.median_ci, 1),
            "TTFT p99 ms": _p99(r.ttft),
            "TPOT median ms": with_interval(r.tpot.median, r.tpot.median_ci, 2),
            "ITL median ms": with_interval(r.itl.median, r.itl.median_ci, 2),
            "E2E median ms": with_interval(r.e2el.median, r.e2el.median_ci, 1),
            "tok/s per GPU": f"{r.output_throughput_per_gpu:.1f}" if r.output_throughput_per_gpu else None,
            "tok/J": f"{r.output_tokens_per_joule:.2f}" if r.output_tokens_per_joule else None,
            "flags": r.flags,
        })
    return pd.DataFrame(rows).dropna(axis="columns", how="all")  # no GPU: no per-GPU or energy columns


def _errors(values: pd.Series, cis: pd.Series) -> list[list[float]]:
    """Matplotlib's yerr: distances from each value down and up to its interval."""
    low = [v - c[0] if isinstance(c, (list, tuple)) else 0.0 for v, c in zip(values, cis)]
    high = [c[1] - v if isinstance(c, (list, tuple)) else 0.0 for v, c in zip(values, cis)]
    return [low, high]


def write_chart(df: pd.DataFrame, path: Path, title: str, *, gpus: int | None = None) -> Path | None:
    """Throughput and latencies against concurrency (where the curve bends is the knee), each with
    its 95% interval, and the trade-off vLLM's sweep plots draw: throughput per GPU against each
    user's decode speed. A level where every request failed has no figures to draw; with no other
    level there is no chart."""
    df = df[df["completed"] > 0]
    if df.empty:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU host or in CI
    import matplotlib.pyplot as plt

    fig, (tput, lat, pareto) = plt.subplots(1, 3, figsize=(16, 4.5))
    tput.errorbar(df["concurrency"], df["output_throughput"], yerr=_errors(df["output_throughput"],
                  df["output_throughput_ci"]), marker="o", capsize=3, label="output tok/s")
    tput.plot(df["concurrency"], df["total_token_throughput"], marker=".", linestyle="--", label="total tok/s")
    tput.set(xlabel="concurrency", ylabel="tokens/s", xscale="log", title="Throughput (95% interval)")
    tput.legend()
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E")):
        median = df[f"median_{key}_ms"]
        line = lat.errorbar(df["concurrency"], median, yerr=_errors(median, df[f"median_{key}_ms_ci"]),
                            marker="o", capsize=3, label=f"median {label}")
        p99 = df[f"p99_{key}_ms"].astype(float)
        if p99.notna().any():
            lat.plot(df["concurrency"], p99, linestyle="--", color=line[0].get_color(), label=f"p99 {label}")
    lat.set(xlabel="concurrency", ylabel="ms", xscale="log", title="Latency (95% interval; p99 from 100 samples)")
    if (df[["median_ttft_ms", "median_e2el_ms"]] > 0).any().any():
        lat.set_yscale("log")
    lat.legend(fontsize="small")
    for axis in (tput, lat):
        axis.set_xticks(df["concurrency"], [str(c) for c in df["concurrency"]])
        axis.set_xticks([], minor=True)  # the log scale's minor labels ("3x10^0") would sit among the levels
    per_user = 1000.0 / df["median_tpot_ms"].where(df["median_tpot_ms"] > 0)
    per_gpu = df["output_throughput"] / (gpus or 1)
    pareto.plot(per_user, per_gpu, marker="o")
    for c, x, y in zip(df["concurrency"], per_user, per_gpu):
        pareto.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize="small")
    pareto.set(xlabel="tok/s per user (1000 / median TPOT)", ylabel="output tok/s per GPU" if gpus else
               "output tok/s (no GPU)", title="Throughput against speed per user")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def verdict_lines(results: list[LevelResult], stop: str | None) -> list[str]:
    """What the sweep found, in words: single stream, the knee, then the findings; the summary's
    bullets and the CLI's closing lines."""
    best = knee(results)
    single = single_stream(results)
    lines = []
    if single is not None:
        lines.append(f"- **Single stream:** {with_interval(single.output_throughput, single.output_throughput_ci)}"
                     " output tok/s")
    if best is not None:
        lines.append(f"- **Peak (knee):** {with_interval(best.output_throughput, best.output_throughput_ci)} output "
                     f"tok/s at concurrency {best.concurrency}" + (f" ({best.flags})" if best.flags else ""))
    else:
        lines.append("- **Peak (knee):** none: no level met the SLO")
    return lines + finding_lines(results, stop)


def finding_lines(results: list[LevelResult], stop: str | None) -> list[str]:
    """Why the sweep ended, and what each raised flag means, once per flag with its levels."""
    lines = [f"- **Sweep ended:** {stop or 'after the last level'}"]
    for flag, meaning in FLAG_MEANINGS.items():
        levels = [str(r.concurrency) for r in results if flag in r.flags.split(", ")]
        if levels:
            lines.append(f"- **{flag}** at concurrency {', '.join(levels)}: {meaning}")
    return lines


def summary_markdown(results: list[LevelResult], title: str, facts: dict[str, str],
                     *, stop: str | None = None, chart_src: str | None = None) -> str:
    """The sweep in words, its chart (`chart_src`: a file name beside it, or a data URI where the
    reader has no file system, as in the Prefect UI) and the headline table."""
    lines = [f"# {title}", ""]
    lines += [f"- **{k}:** {v}" for k, v in facts.items()]
    lines += verdict_lines(results, stop)
    if chart_src is not None:
        lines += ["", f"![Throughput and latency against concurrency]({chart_src})"]
    lines += ["", headline_table(results).to_markdown(index=False)]
    return "\n".join(lines)


def save_results(results: list[LevelResult], results_dir: Path, title: str, *, facts: dict[str, str],
                 stop: str | None, gpus: int | None = None) -> Path | None:
    """results.csv (every figure, vLLM's names), chart.png and summary.md next to the per-level JSON
    files; the chart's path, None where no level had figures to draw."""
    df = bench_table(results)
    results_dir.mkdir(parents=True, exist_ok=True)
    df.to_csv(results_dir / "results.csv", index=False)
    chart = write_chart(df, results_dir / "chart.png", title, gpus=gpus)
    markdown = summary_markdown(results, title, facts, stop=stop, chart_src=chart.name if chart else None)
    (results_dir / "summary.md").write_text(markdown + "\n")
    return chart
