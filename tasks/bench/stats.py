"""95% confidence intervals for a level's figures: how far a number can be trusted.

Latencies are bootstrapped over requests: a request's intervals are resampled together, since they
share its batch and its queue, and treating them as independent would make intervals too narrow.
Throughput is a rate over the measurement window, not a per-request figure, so its interval comes
from batch means: the window cut into equal slices whose rates vary as the server's pace does.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 400
# Beyond this many values a latency's bootstrap runs on an even thinning of them: the interval
# then comes out a little wide, never narrow, and a 256-stream level stays a fraction of a second.
MAX_BOOTSTRAP_VALUES = 20_000
BATCHES = 10
T_975_BATCHES = 2.262  # Student's t, 97.5th percentile, BATCHES - 1 degrees of freedom
# A p99 needs at least one value beyond it to be more than the maximum under another name.
MIN_P99_SAMPLES = 100


def quantile_intervals(values: np.ndarray, groups: np.ndarray, n_groups: int, *, quantiles: tuple[float, ...],
                       seed: int = 0) -> list[tuple[float, float]]:
    """A percentile-bootstrap 95% interval for each quantile (0..1) of `values`, resampling whole
    groups (requests): each resample weights a group by how often it was drawn, and the weighted
    quantile is read off one sort of the values."""
    if len(values) < 2 or n_groups < 2:
        return [(float("nan"), float("nan"))] * len(quantiles)
    rng = np.random.default_rng(seed)
    if len(values) > MAX_BOOTSTRAP_VALUES:
        keep = np.linspace(0, len(values) - 1, MAX_BOOTSTRAP_VALUES).astype(int)
        values, groups = values[keep], groups[keep]
    order = np.argsort(values, kind="stable")
    ordered, owners = values[order], groups[order]
    draws = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=RESAMPLES)
    cumulative = np.cumsum(draws[:, owners], axis=1, dtype=np.float64)
    total = cumulative[:, -1:]
    intervals = []
    for q in quantiles:
        estimates = ordered[np.argmax(cumulative >= q * total, axis=1)]
        low, high = np.percentile(estimates, (2.5, 97.5))
        intervals.append((float(low), float(high)))
    return intervals


def rate_interval(times: np.ndarray, weights: np.ndarray, start: float, *, end: float) -> tuple[float, float]:
    """A 95% interval for the rate of weighted events in [start, end), from BATCHES equal slices."""
    if end <= start:
        return (float("nan"), float("nan"))
    counts, _ = np.histogram(times, bins=BATCHES, range=(start, end), weights=weights)
    rates = counts / ((end - start) / BATCHES)
    half = T_975_BATCHES * rates.std(ddof=1) / np.sqrt(BATCHES)
    return (float(rates.mean() - half), float(rates.mean() + half))
