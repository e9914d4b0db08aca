"""How an ignore or target entry names modules: compressed-tensors' matching, as vLLM names modules.

A `re:` entry is a pattern from the model repo, run over ~300k names: hostile until bounded. It
must compile under Python's `re` (compressed-tensors' engine: the same patterns, the same errors),
and it runs in the `regex` package, which takes a `timeout=` and has Python's syntax and meaning;
every pattern of a run shares one time budget, so one that backtracks catastrophically is refused
in one line, not left running for hours.
"""

from __future__ import annotations

import functools
import os
import re
import time
import warnings
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterator
from itertools import accumulate

import regex

from tasks.errors import CheckpointError
from tasks.trust import shown

# vLLM's fused modules and their stored parts; an ignore entry may name either.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
PART_TO_FUSED = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}
PATTERN_SECONDS = 20.0  # all of one validation's pattern matching; a Kimi-sized one takes well under 1 s
PATTERN_SECONDS_ENV = "ROLLOUT_PATTERN_SECONDS"  # another budget, for a host that needs one (and the tests)


def pattern_seconds() -> float:
    try:
        return max(float(os.environ.get(PATTERN_SECONDS_ENV) or PATTERN_SECONDS), 0.1)
    except ValueError:
        return PATTERN_SECONDS


class PatternBudget:
    """The time one validation's patterns may take together; past it, the pattern running is refused."""

    def __init__(self, seconds: float | None = None):
        self.seconds = seconds or pattern_seconds()
        self.ends = time.monotonic() + self.seconds

    def left(self) -> float:
        return max(self.ends - time.monotonic(), 0.001)

    def exceeded(self, entry: str) -> CheckpointError:
        return CheckpointError(f"config.json: quantization_config: pattern {shown(entry)} still matching when the "
                               f"{self.seconds:.0f} s all patterns share had run out: it backtracks catastrophically; "
                               "refused")


@functools.lru_cache(maxsize=1024)
def compile_entry(entry: str) -> regex.Pattern:
    """A `re:` entry's pattern, or one line naming it: compiled by `re` first, as compressed-tensors
    would, so a pattern it refuses is refused here too."""
    body = entry.removeprefix("re:")
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            re.compile(body)
        compiled = regex.compile(body)
    except (re.error, regex.error, RecursionError, OverflowError) as exc:
        raise CheckpointError(f"config.json: quantization_config: entry {shown(entry)} is not a valid "
                              f"regular expression ({exc})") from exc
    if said:  # re's FutureWarning: a nested set or set operation, `[[:alpha:]]`, which regex reads otherwise
        raise CheckpointError(f"config.json: quantization_config: entry {shown(entry)}: {said[0].message}, which "
                              "Python's re and the regex engine read differently; write it without")
    return compiled


def match_name(name: str, target: str, budget: PatternBudget | None = None) -> bool:
    """compressed-tensors' rule: `re:` entries by re.match (anchored at the start), others exactly."""
    if target.startswith("re:"):
        budget = budget or PatternBudget()
        try:
            return compile_entry(target).match(name, timeout=budget.left()) is not None
        except TimeoutError as exc:
            raise budget.exceeded(target) from exc
    return target == name


class IgnoreMatcher:
    """match_name for every ignore entry over many names at once, with the same results.

    A Kimi-sized checkpoint has ~70k modules and four names each. Each `re:` entry scans all names
    joined by newlines in C to find the lines it may match, and each such line is then decided by
    re.match on the name alone, so the scan may over-find but must never miss: entries whose
    meaning the joined text could change (anchors, lookbehind, negative lookahead, inline flags)
    fall back to one re.match per name.
    """

    def __init__(self, entries: list[str], budget: PatternBudget | None = None):
        self.exact = {e for e in entries if not e.startswith("re:")}
        self.patterns = [(e, compile_entry(e)) for e in entries if e.startswith("re:")]
        self.budget = budget or PatternBudget()

    @staticmethod
    def _scanner(pattern: regex.Pattern) -> regex.Pattern | None:
        body = pattern.pattern
        if re.search(r"\\[AZz]|\(\?<|\(\?!", body):
            return None
        try:
            if body.startswith(".*"):  # `.*X` matches a name that X is found in: search X (C's literal skip)
                return regex.compile(body[2:].removeprefix("?"), regex.MULTILINE)
            return regex.compile(f"(?m)^(?=(?:{body}))")
        except (regex.error, RecursionError, OverflowError):
            return None

    def _lines(self, scanner: regex.Pattern, text: str, line_starts: list[int]) -> Iterator[int]:
        """Each line a scanner hit starts in, once; the search goes on at the next line."""
        pos = 0
        while (m := scanner.search(text, pos, timeout=self.budget.left())) is not None:
            line = bisect_right(line_starts, m.start()) - 1
            yield line
            if line + 1 == len(line_starts):
                return
            pos = line_starts[line + 1]

    def hits(self, names: list[str]) -> dict[int, set[str]]:
        """Index of each name that some entry matches -> the entries matching it."""
        found: dict[int, set[str]] = defaultdict(set)
        for i, n in enumerate(names):
            if n in self.exact:
                found[i].add(n)
        if not names:
            return found
        text = "\n".join(names)
        line_starts = list(accumulate((len(n) + 1 for n in names[:-1]), initial=0))
        for entry, pattern in self.patterns:
            scanner = self._scanner(pattern)
            try:
                lines = range(len(names)) if scanner is None else self._lines(scanner, text, line_starts)
                for i in lines:
                    if pattern.match(names[i], timeout=self.budget.left()):
                        found[i].add(entry)
            except TimeoutError as exc:
                raise self.budget.exceeded(entry) from exc
        return found


def engine_names(name: str) -> list[str]:
    """The names an ignore entry may be written against: as stored, as vLLM names it, fused."""
    names = [name]
    if name.startswith("language_model."):  # vLLM drops the wrapper for lm_head and friends
        names.append(name.removeprefix("language_model."))
    parent, _, leaf = name.rpartition(".")
    if leaf in PART_TO_FUSED:
        names += [f"{n.rpartition('.')[0]}.{PART_TO_FUSED[leaf]}" for n in list(names)]
    return names
