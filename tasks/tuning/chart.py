"""The trade-off a serving configuration is chosen by: throughput per GPU against speed per user."""

from __future__ import annotations

import io

from tasks.tuning.measure import CandidateResult


def pareto_chart(results: list[CandidateResult], best: CandidateResult | None) -> bytes | None:
    """One line per measured candidate through its levels (concurrency labelled): up is more tokens
    from each GPU, right is a faster stream for each user. The frontier is what no other candidate
    beats on both; the winner is drawn thick."""
    measured = [r for r in results if r.status == "measured" and r.levels]
    if not measured:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU host or in CI
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(9, 5.5))
    for r in measured:
        levels = [lv for lv in r.levels if lv.completed and lv.tpot.median]
        x = [1000.0 / lv.tpot.median for lv in levels]
        y = [lv.output_throughput / r.gpus for lv in levels]
        axis.plot(x, y, marker="o", linewidth=3 if r is best else 1, label=r.name + ("  (winner)" if r is best else ""))
        for lv, xi, yi in zip(levels, x, y):
            axis.annotate(str(lv.concurrency), (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize="x-small")
    axis.set(xlabel="tok/s per user (1000 / median TPOT)", ylabel="output tok/s per GPU",
             title="Candidates: throughput per GPU against speed per user (labels: concurrency)")
    axis.legend(fontsize="x-small")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=90)
    plt.close(fig)
    return out.getvalue()
