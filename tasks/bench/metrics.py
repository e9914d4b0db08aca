"""vLLM's /metrics during a level: what the server's scheduler saw while the client measured."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tasks.bench.results import ServerSamples

# The samples a level reads. vLLM's /metrics is ~50 KB of histograms (it ignores Prometheus's
# `name[]` filter); parsed whole it held the client's event loop 11 ms every scrape, and each
# chunk timestamp waited as long (the demo's levels were all flagged client-limited).
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE, KV_USAGE_V0 = "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"
GENERATED = "vllm:generation_tokens_total"
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
SAMPLES = frozenset({RUNNING, WAITING, KV_USAGE, KV_USAGE_V0, GENERATED, PREFIX_QUERIES, PREFIX_HITS})


def parse_metrics(text: str) -> dict[str, float]:
    """The named samples, summed over label sets (engines, models): one server's totals. Other
    lines are dropped before the Prometheus parser sees them."""
    kept = "\n".join(line for line in text.splitlines()
                      if line[:1] not in ("#", "") and line.partition("{")[0].partition(" ")[0] in SAMPLES)
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(kept + "\n"):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def scrape(http: httpx.AsyncClient, url: str, samples: ServerSamples, *, interval_s: float) -> None:
    while True:
        try:
            response = await http.get(url)
            if response.status_code != 200:
                return  # not a vLLM server: no server-side view
            values = parse_metrics(response.text)
        except (httpx.HTTPError, ValueError):
            return
        if not values:
            return  # metrics, but not vLLM's
        samples.running.append(values.get(RUNNING, 0.0))
        samples.waiting.append(values.get(WAITING, 0.0))
        samples.kv_usage.append(values.get(KV_USAGE, values.get(KV_USAGE_V0, 0.0)))
        _counters(values, samples)
        await asyncio.sleep(interval_s)


def _counters(values: dict[str, float], samples: ServerSamples) -> None:
    samples.generated.append(values.get(GENERATED, 0.0))
    samples.prefix_queries.append(values.get(PREFIX_QUERIES, 0.0))
    samples.prefix_hits.append(values.get(PREFIX_HITS, 0.0))


async def scrape_once(http: httpx.AsyncClient, url: str, samples: ServerSamples) -> None:
    """The counters after the last request, so the level's tokens and cache lookups are complete."""
    if samples.generated:
        try:
            _counters(parse_metrics((await http.get(url)).text), samples)
        except (httpx.HTTPError, ValueError):
            pass


async def reset_prefix_cache(http: httpx.AsyncClient, base_url: str) -> bool:
    """vLLM's POST /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1); elsewhere a no-op."""
    try:
        return (await http.post(f"{base_url}/reset_prefix_cache")).status_code == 200
    except httpx.HTTPError:
        return False
