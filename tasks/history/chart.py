"""The history chart: throughput and p99 TTFT per revision over time, one line per model and GPU type."""

from __future__ import annotations

import io
from datetime import timedelta

from tasks.history.runs import RunRecord


def history_chart(records: list[RunRecord]) -> bytes | None:
    """A PNG (bytes, for embedding where the reader has no file system); None with no benchmarked run.
    Each point is one run, labelled with its revision; a regressed or failed run is drawn hollow."""
    measured = [r for r in records if r.peak_tok_s is not None]
    if not measured:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU host or in CI
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(14, 4.5))
    series: dict[tuple[str, str], list[RunRecord]] = {}
    for record in sorted(measured, key=lambda r: r.time):
        series.setdefault((record.model, record.gpu), []).append(record)
    for (model, gpu), runs in series.items():
        times = [r.time for r in runs]
        line = tput.plot(times, [r.peak_tok_s for r in runs], marker="o", label=f"{model} on {gpu}: peak")[0]
        tput.plot(times, [r.single_stream_tok_s for r in runs], marker=".", linestyle="--", color=line.get_color(),
                  label=f"{model} on {gpu}: single stream")
        ttft.plot(times, [r.p99_ttft_ms for r in runs], marker="o", color=line.get_color(), label=f"{model} on {gpu}")
        for r in runs:
            if r.status != "passed":
                tput.plot([r.time], [r.peak_tok_s], marker="o", markersize=12, fillstyle="none", color="red")
            tput.annotate(r.commit[:7], (r.time, r.peak_tok_s), textcoords="offset points", xytext=(4, 4),
                          fontsize="x-small")
    tput.set(ylabel="output tok/s", title="Throughput per revision (red ring: regressed or failed)")
    ttft.set(ylabel="ms", title="p99 TTFT at the knee per revision")
    if all(r.p99_ttft_ms is None for r in measured):
        ttft.text(0.5, 0.5, "no run had enough requests at its knee for a p99", ha="center", va="center",
                  transform=ttft.transAxes)
    for axis in (tput, ttft):
        axis.legend(fontsize="x-small")
        axis.tick_params(axis="x", labelrotation=20, labelsize="small")
        if len({r.time for r in measured}) == 1:  # one point: a day either side, not matplotlib's years
            axis.set_xlim(measured[0].time - timedelta(days=1), measured[0].time + timedelta(days=1))
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=90)
    plt.close(fig)
    return out.getvalue()
