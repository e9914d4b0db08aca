"""The answer check under load: the probes asked again while long requests fill the KV cache.

Some servers answer right when idle and degenerate when full: Kimi-K2.6 on vLLM answers "!!!!" once
the context passes 100K tokens and the KV cache is over 90% full (vllm-project/vllm#42426). An idle
probe at short context never sees it. So, after the idle check: long requests near max_model_len
(random token ids, ignore_eos) are streamed until vLLM's `vllm:kv_cache_usage_perc` passes the
target, the probes are asked then, all at once, and their greedy answers must be the idle ones,
not degenerate, with finite logprobs. How many requests fill the cache comes from the server's own
`vllm:cache_config_info` (blocks x block size): as many as fit whole, so none is preempted.
"""

from __future__ import annotations

import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tasks.answers.check import LoadedAnswers, Probe, ProbeResult, _correct, degeneration

CACHE_INFO, KV_USAGE = "vllm:cache_config_info", "vllm:kv_cache_usage_perc"
MAX_FILLS = 256  # requests; a cache that needs more is filled as far as these reach
# A batch changes the numerics (vLLM is not batch-invariant by default): a near-tie may fall the
# other way under load. More than this share of probes lost is no near-tie.
MAX_LOST = 0.1


def _samples(metrics_text: str, name: str):
    """One metric's samples; the other ~50 KB of vLLM's /metrics never reach the parser."""
    kept = "\n".join(line for line in metrics_text.splitlines() if line.startswith(name))
    for family in text_string_to_metric_families(kept + "\n"):
        yield from family.samples


def kv_capacity_tokens(metrics_text: str) -> int | None:
    """Tokens the KV cache holds: blocks x block size from vLLM's cache_config_info; None without it."""
    for sample in _samples(metrics_text, CACHE_INFO):
        blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
        if blocks and size and blocks.isdigit() and size.isdigit():
            return int(blocks) * int(size)
    return None


def _fill(http: httpx.Client, base_url: str, model: str, prompt: list[int], max_tokens: int,
          stop: threading.Event) -> None:
    """One long request, streamed until it ends or the probes are done (closing it frees its blocks)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    try:
        with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return
    except httpx.HTTPError:
        return  # a refused or cut fill leaves the cache emptier; the usage figure says so


def _usage(http: httpx.Client, base_url: str) -> float | None:
    """The fullest engine's share of its KV cache in use."""
    try:
        values = [s.value for s in _samples(http.get(f"{base_url}/metrics").text, KV_USAGE)]
    except httpx.HTTPError:
        return None
    return max(values) if values else None


def _fill_prompts(count: int, length: int, vocab_size: int) -> list[list[int]]:
    """Random token ids, the same every run; past the first 100 ids, where special tokens sit."""
    rng = random.Random(0x6B76)
    return [[rng.randrange(min(100, vocab_size - 1), vocab_size) for _ in range(length)] for _ in range(count)]


def _ask(http: httpx.Client, base_url: str, model: str, probe: Probe, max_tokens: int) -> tuple[ProbeResult, bool]:
    """A probe's greedy answer, and whether its logprobs are all finite numbers."""
    reply = http.post(f"{base_url}/v1/completions", json={
        "model": model, "prompt": probe.prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1}).json()
    choice = (reply.get("choices") or [{}])[0]
    output = choice.get("text") or ""
    logprobs = [v for v in ((choice.get("logprobs") or {}).get("token_logprobs") or []) if v is not None]
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in logprobs)
    return ProbeResult(prompt=probe.prompt, expected=probe.expected, output=output,
                       correct=_correct(output, probe.expected)), finite


def check_under_load(base_url: str, model: str, probes: list[Probe], *, idle: list[ProbeResult], max_model_len: int,
                     vocab_size: int, max_tokens: int = 16, target: float = 0.9, timeout_s: float = 120.0,
                     api_key: str | None = None, max_num_seqs: int | None = None) -> LoadedAnswers:
    """Fill the KV cache past `target`, ask the probes, compare with their idle answers. A server that
    runs fewer sequences at once (`max_num_seqs`) than it takes to fill the cache is not loaded at all:
    the long requests would only queue, for up to `timeout_s`, and never reach the target."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s, headers=headers) as http:
        try:
            capacity = kv_capacity_tokens(http.get(f"{base_url}/metrics").text)
        except httpx.HTTPError:
            capacity = None
        if capacity is None:
            return LoadedAnswers(target=target, kv_usage=None, fills=0,
                                 skipped="the server reports no KV cache size (vllm:cache_config_info)")
        generate = max(1, min(64, max_model_len // 8))  # the prompts alone fill the cache to ~90%
        fills = max(1, min(MAX_FILLS, math.floor(0.98 * capacity / max_model_len)))  # whole requests fit: no preemption
        if max_num_seqs is not None and max_num_seqs * max_model_len < target * capacity:
            return LoadedAnswers(target=target, kv_usage=None, fills=0, skipped=(
                f"at most {max_num_seqs} sequences run at once (max_num_seqs): {max_num_seqs} x {max_model_len} "
                f"tokens fill {max_num_seqs * max_model_len / capacity:.0%} of the KV cache, short of {target:.0%}"))
        prompts = _fill_prompts(fills, max_model_len - generate, vocab_size)
        stop, peak = threading.Event(), None
        with ThreadPoolExecutor(max_workers=fills + len(probes)) as pool:
            filling = [pool.submit(_fill, http, base_url, model, p, generate, stop) for p in prompts]
            deadline = time.monotonic() + timeout_s
            try:
                while time.monotonic() < deadline and not all(f.done() for f in filling):
                    usage = _usage(http, base_url)
                    if usage is not None and usage >= target:
                        break
                    time.sleep(0.2)
                asked = [pool.submit(_ask, http, base_url, model, p, max_tokens) for p in probes]
                while not all(a.done() for a in asked):
                    usage = _usage(http, base_url)
                    peak = usage if peak is None or (usage or 0) > peak else peak
                    time.sleep(0.2)
                answers = [a.result() for a in asked]
            finally:
                stop.set()
    results = [r for r, _ in answers]
    report = LoadedAnswers(target=target, kv_usage=peak, fills=fills, results=results)
    if peak is None or peak < target:
        report.skipped = (f"the KV cache reached {peak:.0%}, short of {target:.0%}, with {fills} long requests"
                          if peak is not None else "the server reports no KV cache usage")
    report.problems = _judge(results, idle, sum(not finite for _, finite in answers), peak)
    return report


def _judge(results: list[ProbeResult], idle: list[ProbeResult], not_finite: int, usage: float | None) -> list[str]:
    where = f"with the KV cache {usage:.0%} full" if usage is not None else "under load"
    problems = [f"{problem} {where}" for problem in degeneration([r.output for r in results])]
    right_idle = {r.prompt for r in idle if not r.chat and r.correct}
    lost = [r for r in results if r.prompt in right_idle and not r.correct]
    if len(lost) > MAX_LOST * len(results):
        problems.append(f"{len(lost)} of {len(results)} probes right when idle are wrong {where}, for example "
                        f"{lost[0].prompt[:30]!r} -> {lost[0].output[:30]!r}")
    if not_finite:
        problems.append(f"{not_finite} of {len(results)} probes with NaN or infinite logprobs {where}")
    return problems
