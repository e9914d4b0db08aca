"""The reference text, token by token: the answer check's paired test against the last good
deployment (issue 39's blind spot).

A damage that leaves a probe's first answers right and breaks what follows (" 15 16 17" then
" 17 17 13" instead of " 18 19 20") passed every rule that scores answers, and raised the
reference text's perplexity about 1.2-1.3x, under the ratio's 1.5x limit: one mean of a few dozen
tokens, with a threshold loose enough for any new revision. The same tokens, compared one by one
with the last good deployment's log-probabilities, tell a model that got worse from one that
changed: a damaged model makes most tokens less likely (a sign test on the pairs, one-sided), a
retrained one as many more likely as less (benchmarks/damage.py --blind-spot: every damage at
p < 0.001, a model retrained from another seed at p 0.83, a re-publish every pair tied). The mean
change in nats per token is the effect floor: a systematic shift too small to matter passes.
"""

from __future__ import annotations

import math


def sign_test(new: list[float], old: list[float]) -> tuple[float, float, int, int]:
    """Mean change in negative log-probability per token (positive: less likely now), the one-sided
    sign test's p that `worse` or more of the untied pairs got less likely by chance, and the counts
    of tokens less and more likely. Ties (a re-publish's every token) count for neither."""
    worse = sum(n > o + 1e-4 for n, o in zip(new, old))
    better = sum(n < o - 1e-4 for n, o in zip(new, old))
    return sum(n - o for n, o in zip(new, old)) / len(new), one_sided_p(worse, better), worse, better


def one_sided_p(worse: int, better: int) -> float:
    """The chance of `worse` or more of `worse + better` untied pairs going one way if either way
    were as likely (exact binomial, p = 1/2): the sign test here, the exact McNemar test on flipped
    probes in check.py."""
    n = worse + better
    return sum(math.comb(n, k) for k in range(worse, n + 1)) / 2 ** n if n else 1.0


def reference_drift(new: list[float] | None, old: list[float] | None, *, max_p: float,
                    min_change: float) -> str | None:
    """The problem line where the reference text's tokens got less likely than for the last good
    deployment beyond chance and by more than `min_change` nats per token; None where not, or where
    the two cannot be paired (no prompt logprobs, or a text tokenized otherwise: a new vocabulary)."""
    if not new or not old or len(new) != len(old):
        return None
    change, p, worse, better = sign_test(new, old)
    if p >= max_p or change <= min_change:
        return None
    return (f"the reference text's tokens are less likely than for the last good deployment: {worse} of "
            f"{len(new)} tokens less likely, {better} more (sign test p={p:.2g}, below {max_p:g}), "
            f"+{change:.3f} nats per token (x{math.exp(change):.2f} perplexity; floor {min_change:g})")
