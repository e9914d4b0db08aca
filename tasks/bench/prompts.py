"""A level's prompts and send times: token ids of exact length, a tokenizer's text, or a dataset."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np

from tasks.bench.spec import BenchSpec
from tasks.errors import BenchConfigError


def make_prompts(count: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts of exactly input_len tokens, away from the special ids at both vocab ends."""
    rng = np.random.default_rng(seed)
    low, high = min(100, vocab_size // 10), vocab_size - min(1000, vocab_size // 10)
    return rng.integers(low, high, size=(count, input_len)).tolist()


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def level_prompts(spec: BenchSpec, concurrency: int, vocab_size: int | None,
                  tokenizer: str | Path | None) -> list[list[int]] | list[str]:
    """A level's prompts (at least one per slot), then one more for its warm-up, so that no measured
    request finds its prompt already in the server's prefix cache: the dataset's, or random ids (text
    for chat, or where the server takes no ids). Each level has its own seed: no level repeats another's."""
    count, seed = max(spec.requests_per_level, concurrency) + 1, spec.seed + concurrency
    if spec.dataset is not None:
        try:
            texts = [json.loads(line)["prompt"] for line in spec.dataset.read_text().splitlines() if line.strip()]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BenchConfigError(f"{spec.dataset}: not JSONL of {{\"prompt\": text}} ({exc})") from exc
        if not texts:
            raise BenchConfigError(f"{spec.dataset}: no prompts")
        return [texts[i % len(texts)] for i in range(count)]
    if spec.api == "completions" and vocab_size is not None and spec.token_id_prompts:
        return make_prompts(count, spec.input_len, vocab_size, seed)  # token ids: exact input lengths
    if tokenizer is None and not spec.token_id_prompts:
        return text_prompts(count, spec.input_len, seed)
    if tokenizer is None:
        raise BenchConfigError(f"{spec.api} prompts need the served model's tokenizer"
                               + (" (or its vocab size)" if spec.api == "completions" else "") + ", or a dataset")
    try:
        tok = _tokenizer(str(tokenizer))
    except Exception as exc:  # a tokenizer that needs remote code, a missing file, ...
        raise BenchConfigError(f"tokenizer {tokenizer}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    ids = make_prompts(count, spec.input_len, len(tok), seed)
    return [tok.decode(p) for p in ids] if spec.api == "chat" or not spec.token_id_prompts else ids


# Short common words: about one token each in any English BPE vocabulary.
_WORDS = ("the model serves tokens over many experts while a router picks two of eight for each token and "
          "attention keeps keys and values in a small cache on every device in the box during a long run at "
          "high load so that users see their first word soon and the rest at an even pace").split()


def text_prompts(count: int, input_len: int, seed: int) -> list[str]:
    """Text of input_len words, different per prompt, for a server whose tokenizer is not at hand:
    its own usage counts then say how many tokens each prompt was."""
    rng = np.random.default_rng(seed)
    return [" ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), input_len)) for _ in range(count)]


def arrival_offsets(count: int, rate: float | None, burstiness: float, seed: int) -> np.ndarray:
    """Send times from the level's start: gamma gaps with mean 1/rate, as vLLM's serve benchmark."""
    if rate is None or math.isinf(rate):
        return np.zeros(count)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps)
