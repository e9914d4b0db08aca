"""How an ignore or target entry names modules: compressed-tensors' matching, as vLLM names modules."""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterator
from itertools import accumulate

# vLLM's fused modules and their stored parts; an ignore entry may name either.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
PART_TO_FUSED = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' rule: `re:` entries by re.match (anchored at the start), others exactly."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target == name


class IgnoreMatcher:
    """match_name for every ignore entry over many names at once, with the same results.

    A Kimi-sized checkpoint has ~70k modules and four names each. Each `re:` entry scans all names
    joined by newlines in C to find the lines it may match, and each such line is then decided by
    re.match on the name alone, so the scan may over-find but must never miss: entries whose
    meaning the joined text could change (anchors, lookbehind, negative lookahead, inline flags)
    fall back to one re.match per name.
    """

    def __init__(self, entries: list[str]):
        self.exact = {e for e in entries if not e.startswith("re:")}
        self.patterns = [(e, re.compile(e.removeprefix("re:"))) for e in entries if e.startswith("re:")]

    @staticmethod
    def _scanner(pattern: re.Pattern) -> re.Pattern | None:
        body = pattern.pattern
        if re.search(r"\\[AZz]|\(\?<|\(\?!", body):
            return None
        try:
            if body.startswith(".*"):  # `.*X` matches a name that X is found in: search X (C's literal skip)
                return re.compile(body[2:].removeprefix("?"), re.MULTILINE)
            return re.compile(f"(?m)^(?=(?:{body}))")
        except re.error:
            return None

    @staticmethod
    def _lines(scanner: re.Pattern, text: str, line_starts: list[int]) -> Iterator[int]:
        """Each line a scanner hit starts in, once; the search goes on at the next line."""
        pos = 0
        while (m := scanner.search(text, pos)) is not None:
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
            lines = range(len(names)) if scanner is None else self._lines(scanner, text, line_starts)
            for i in lines:
                if pattern.match(names[i]):
                    found[i].add(entry)
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
