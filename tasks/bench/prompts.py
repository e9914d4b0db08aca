"""A level's prompts and send times: token ids of exact length, a tokenizer's text, or a dataset."""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tasks.bench.spec import BenchSpec
from tasks.errors import BenchConfigError


def _id_stream(input_len: int, vocab_size: int, seed) -> Iterator[list[int]]:
    """Token-id prompts of exactly input_len tokens, endless, away from the special ids at both vocab ends."""
    rng = np.random.default_rng(seed)
    low, high = min(100, vocab_size // 10), vocab_size - min(1000, vocab_size // 10)
    while True:
        yield from rng.integers(low, high, size=(64, input_len)).tolist()


def make_prompts(count: int, input_len: int, vocab_size: int, *, seed) -> list[list[int]]:
    return list(itertools.islice(_id_stream(input_len, vocab_size, seed), count))


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def level_prompts(spec: BenchSpec, concurrency: int, vocab_size: int | None, *, tokenizer: str | Path | None,
                  repeat: int = 0) -> Iterator[list[int] | str]:
    """A level's prompts, as many as it sends, the warm-up's own first, so that no measured request
    finds its prompt already in the server's prefix cache: the dataset's, or random ids (text for
    chat, or where the server takes no ids). Each level and each repeat of it has its own seed, so
    none sends another's prompts. Bad input fails here, before anything is sent."""
    seed = (spec.seed, concurrency, repeat)
    if spec.dataset is not None:
        try:
            texts = [json.loads(line)["prompt"] for line in spec.dataset.read_text().splitlines() if line.strip()]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BenchConfigError(f"{spec.dataset}: not JSONL of {{\"prompt\": text}} ({exc})") from exc
        if not texts:
            raise BenchConfigError(f"{spec.dataset}: no prompts")
        return itertools.cycle(texts)
    if spec.api == "completions" and vocab_size is not None and spec.token_id_prompts:
        return _id_stream(spec.input_len, vocab_size, seed)  # token ids: exact input lengths
    if tokenizer is None and not spec.token_id_prompts:
        return _text_stream(spec.input_len, seed)
    if tokenizer is None:
        raise BenchConfigError(f"{spec.api} prompts need the served model's tokenizer"
                               + (" (or its vocab size)" if spec.api == "completions" else "") + ", or a dataset")
    try:
        tok = _tokenizer(str(tokenizer))
    except Exception as exc:  # a tokenizer that needs remote code, a missing file, ...
        raise BenchConfigError(f"tokenizer {tokenizer}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    ids = _id_stream(spec.input_len, len(tok), seed)
    return map(tok.decode, ids) if spec.api == "chat" or not spec.token_id_prompts else ids


# Short common words: about one token each in any English BPE vocabulary.
_WORDS = ("the model serves tokens over many experts while a router picks two of eight for each token and "
          "attention keeps keys and values in a small cache on every device in the box during a long run at "
          "high load so that users see their first word soon and the rest at an even pace").split()


def _text_stream(input_len: int, seed) -> Iterator[str]:
    """Text of input_len words, different per prompt, for a server whose tokenizer is not at hand:
    its own usage counts then say how many tokens each prompt was."""
    rng = np.random.default_rng(seed)
    while True:
        yield " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), input_len))


def arrival_times(rate: float | None, burstiness: float, seed) -> Iterator[float]:
    """Send times from the level's start: gamma gaps with mean 1/rate, as vLLM's serve benchmark;
    without a rate, all at once."""
    if rate is None or math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    rng, at = np.random.default_rng(seed), 0.0
    while True:
        yield at
        at += rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness))
