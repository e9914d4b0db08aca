"""Metric definitions, checked on records with known timings and against a server with known delays."""

import asyncio
import itertools
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from tasks.bench.load import _watch_loop, run_level
from tasks.bench.metrics import parse_metrics
from tasks.bench.prompts import arrival_times, level_prompts, make_prompts
from tasks.bench.report import save_results
from tasks.bench.results import Latency, LevelRun, RequestRecord, ServerSamples, summarize
from tasks.bench.spec import BenchSpec, geometric_levels
from tasks.bench.sweep import knee, stop_reason, sweep
from tasks.cpus import server_and_client_cpus
from tasks.errors import BenchConfigError
from testkit.levels import level_result
from testkit.openai_server import StreamingServer

pytestmark = pytest.mark.quiet  # measures speed: runs alone, before the parallel part (Makefile)

SPEC = BenchSpec(input_len=16, output_len=20, requests_per_level=8)


def _run(records, duration_s=2.0, lags=(), cpu_s=0.1, server=None) -> LevelRun:
    return LevelRun(records, duration_s, 0.0, list(lags), cpu_s, server or ServerSamples())


def _ok(**measured) -> RequestRecord:
    """A completed request whose first chunk was its first content, one token per chunk."""
    return RequestRecord(ok=True, ttfc_s=measured.get("ttft_s"), token_itl_s=list(measured.get("itl_s", [])),
                         **measured)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = _ok(start_s=0, e2e_s=1.0, ttft_s=0.1, itl_s=[0.1] * 9, prompt_tokens=5, output_tokens=10)
    assert r.tpot_s == pytest.approx(0.1)
    assert _ok(start_s=0, e2e_s=1.0, ttft_s=0.1, output_tokens=1).tpot_s is None


def test_summary_uses_server_token_counts_wall_time_and_vllm_keys():
    records = [
        _ok(start_s=0, e2e_s=0.5, ttft_s=0.05, itl_s=[0.01, 0.02], prompt_tokens=64,
                      output_tokens=32),
        _ok(start_s=0, e2e_s=0.7, ttft_s=0.15, itl_s=[0.03], prompt_tokens=64, output_tokens=32),
        RequestRecord(ok=False, start_s=0, e2e_s=0.1, error="APIConnectionError"),
    ]
    row = summarize(2, _run(records), SPEC)
    assert (row.requests, row.completed, row.failed) == (3, 2, 1)
    assert row.errors == "APIConnectionError=1" and "failures" in row.flags
    assert row.output_throughput == pytest.approx(32.0)
    assert row.total_token_throughput == pytest.approx(96.0)
    assert row.ttft.mean == pytest.approx(100.0)
    assert row.itl.mean == pytest.approx(20.0)
    assert row.ttft.std == pytest.approx(50.0)
    assert row.tpot.mean == pytest.approx(((0.45 / 31) + (0.55 / 31)) / 2 * 1000)
    assert row.request_goodput is None and row.within_slo is None  # no SLO given


def test_goodput_counts_requests_within_every_slo():
    fast = _ok(start_s=0, e2e_s=0.5, ttft_s=0.05, prompt_tokens=8, output_tokens=11)  # TPOT 45 ms
    slow_first = _ok(start_s=0, e2e_s=0.9, ttft_s=0.4, prompt_tokens=8, output_tokens=11)
    slow_decode = _ok(start_s=0, e2e_s=1.05, ttft_s=0.05, prompt_tokens=8, output_tokens=11)
    spec = SPEC.model_copy(update=dict(slo_ttft_ms=100, slo_tpot_ms=50, slo_attainment=0.5))
    row = summarize(3, _run([fast, slow_first, slow_decode], duration_s=2.0), spec)
    assert row.request_goodput == pytest.approx(0.5)  # one good request in 2 s
    assert row.slo_attainment == pytest.approx(1 / 3)
    assert row.within_slo is False and "slo-missed" in row.flags
    assert summarize(3, _run([fast, fast, slow_first]), spec).within_slo is True  # 2/3 >= 50%


def test_prompts_are_exact_length_reproducible_and_avoid_vocab_ends():
    a = make_prompts(4, 128, vocab_size=163840, seed=7)
    assert a == make_prompts(4, 128, vocab_size=163840, seed=7) and a != make_prompts(4, 128, 163840, seed=8)
    assert all(len(p) == 128 for p in a)
    assert min(min(p) for p in a) >= 100 and max(max(p) for p in a) < 163840 - 1000


def test_chat_prompts_come_from_the_tokenizer_or_a_dataset(hub_root, tmp_path):
    chat = SPEC.model_copy(update=dict(api="chat", input_len=32))
    texts = list(itertools.islice(level_prompts(chat, 4, None, tokenizer=hub_root / "demo" / "tiny-moe"), 9))
    assert len(set(texts)) == 9 and all(isinstance(t, str) and t for t in texts)
    with pytest.raises(BenchConfigError, match="tokenizer"):
        level_prompts(chat, 4, 32000, tokenizer=None)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello"}\n{"prompt": "world"}\n')
    cycled = level_prompts(chat.model_copy(update=dict(dataset=data)), 1, None, tokenizer=None)
    assert list(itertools.islice(cycled, 3)) == ["hello", "world", "hello"]
    data.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(BenchConfigError, match=str(data)):
        level_prompts(chat.model_copy(update=dict(dataset=data)), 1, None, tokenizer=None)


def _offsets(count: int, rate: float | None, burstiness: float, seed: int) -> np.ndarray:
    return np.fromiter(itertools.islice(arrival_times(rate, burstiness, seed), count), float)


def test_arrivals_are_poisson_at_the_rate_and_burstiness_shapes_them():
    steady = np.diff(_offsets(4000, rate=20.0, burstiness=1.0, seed=1))
    assert steady.mean() == pytest.approx(1 / 20, rel=0.05)
    assert (steady.std() / steady.mean()) ** 2 == pytest.approx(1.0, rel=0.1)  # exponential gaps
    bursty = np.diff(_offsets(4000, rate=20.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.1)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.15)  # CV^2 = 1 / burstiness
    assert not _offsets(5, None, 1.0, 0).any()  # no rate: all at once


@pytest.mark.parametrize("concurrency", [1, 32, 128])
def test_measured_latencies_match_what_the_server_injected(concurrency):
    ttft, itl = 0.200, 0.020
    spec = SPEC.model_copy(update=dict(level_duration_s=2.0, requests_per_level=None))
    with StreamingServer(ttft_s=ttft, itl_s=itl) as server:
        row = run_level(server.base_url, "fake", spec, concurrency=concurrency, vocab_size=1000)
    assert row.failed == 0 and row.steady and row.measured >= concurrency
    for metric, injected in (("ttft", ttft), ("ttfc", ttft), ("tpot", itl), ("itl", itl), ("token_itl", itl)):
        measured = getattr(row, metric).median / 1000
        assert abs(measured - injected) <= max(0.05 * injected, 0.002), (metric, measured, injected)
    assert "client-limited" not in row.flags


@pytest.mark.parametrize("concurrency", [1, 32])
def test_chat_ttft_is_vllms_first_chunk_and_ttfc_waits_for_content(concurrency, hub_root):
    # Chat streams open with a role-only chunk at once: vLLM's TTFT counts it, and its ITL then
    # holds the wait for the first content; TTFC and token ITL do not.
    ttft, itl = 0.200, 0.020
    spec = SPEC.model_copy(update=dict(api="chat", requests_per_level=max(8, 2 * concurrency)))
    with StreamingServer(ttft_s=ttft, itl_s=itl) as server:
        row = run_level(server.base_url, "fake", spec, concurrency=concurrency,
                        tokenizer=hub_root / "demo" / "tiny-moe")
    assert row.failed == 0 and row.total_output_tokens == max(8, 2 * concurrency) * 20
    assert row.ttft.median < 20 and abs(row.ttfc.median / 1000 - ttft) <= 0.01
    # The wait for content is in one vLLM ITL per request and in no token ITL (a max under load on
    # two cores can stray by a scheduling slice, so the bound is half the wait, not the 20 ms). That
    # ITL runs from the role chunk's arrival, up to ttft after the request left, to the content's,
    # 200 ms after it: at least the wait less the slowest role chunk (199.8 ms once, a role chunk
    # 0.2 ms on its way).
    assert row.itl.max >= ttft * 1000 - row.ttft.max and row.token_itl.max < ttft * 1000 / 2
    assert abs(row.token_itl.median / 1000 - itl) <= 0.002


def test_a_chunk_of_k_tokens_is_one_vllm_itl_and_k_token_itls():
    spec = SPEC.model_copy(update=dict(output_len=24, requests_per_level=4))
    with StreamingServer(ttft_s=0.05, itl_s=0.010, tokens_per_chunk=4) as server:
        row = run_level(server.base_url, "fake", spec, concurrency=1, vocab_size=1000)
        plain = run_level(server.base_url, "fake", spec.model_copy(update=dict(continuous_usage=False)), concurrency=1,
                          vocab_size=1000)
    assert row.total_output_tokens == 4 * 24
    assert row.itl.median == pytest.approx(40.0, abs=2.0)  # vLLM's: one interval per chunk
    assert row.token_itl.median == pytest.approx(10.0, abs=2.0)  # 40 ms gaps, 4 tokens each
    assert plain.token_itl.median == pytest.approx(40.0, abs=2.0)  # without per-chunk usage: per chunk
    assert plain.total_output_tokens == 4 * 24  # counts from the final usage either way


def test_server_queueing_is_scraped_from_metrics_and_flagged(tmp_path):
    spec = SPEC.model_copy(update=dict(output_len=20, requests_per_level=16))
    with StreamingServer(ttft_s=0.02, itl_s=0.010, slots=4) as server:
        fits = run_level(server.base_url, "fake", spec, concurrency=4, vocab_size=1000, scrape_interval_s=0.05)
        queued = run_level(server.base_url, "fake", spec, concurrency=8, vocab_size=1000, scrape_interval_s=0.05,
                           results_dir=tmp_path)
    assert fits.server_waiting_max == 0 and "queued" not in fits.flags
    assert fits.server_running_max == 4
    assert queued.server_waiting_max >= 1 and "queued" in queued.flags
    assert queued.server_kv_cache_usage_max == pytest.approx(1.0) and "kv-cache-full" in queued.flags
    assert queued.server_output_throughput == pytest.approx(queued.output_throughput, rel=0.25)
    saved = json.loads((tmp_path / "level-c0008.json").read_text())
    vllm_keys = {"date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                 "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                 "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                 "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors",
                 "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                 "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms"}
    assert vllm_keys <= saved.keys()
    assert saved["output_lens"] == [20] * 16 and len(saved["itls"][0]) == 19


def test_only_the_samples_a_level_reads_are_parsed_summed_over_engines():
    # vLLM's exposition, abridged: two engines, a longer name sharing a prefix, histograms, comments.
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 7.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 1200.0',
        'vllm:generation_tokens_created{engine="0",model_name="m"} 1.79e+09',
        *(f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="{le}"}} 4.0' for le in ("0.3", "+Inf")),
        "http_requests_total 9.0",
    ])
    assert parse_metrics(text) == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 1.0,
                                   "vllm:generation_tokens_total": 1200.0}
    assert parse_metrics("<html>Not Found</html>") == {}  # not vLLM's: no server-side view


@pytest.mark.parametrize("resets", [True, False])
def test_no_measured_prompt_is_in_the_prefix_cache_and_the_hit_rate_is_scraped(resets):
    spec = SPEC.model_copy(update=dict(output_len=4, requests_per_level=6))
    with StreamingServer(resets=resets) as server:
        first = run_level(server.base_url, "fake", spec, concurrency=2, vocab_size=1000, scrape_interval_s=0.05)
        again = run_level(server.base_url, "fake", spec, concurrency=2, vocab_size=1000,
                          scrape_interval_s=0.05)  # same prompts
        other = run_level(server.base_url, "fake", spec, concurrency=3, vocab_size=1000, scrape_interval_s=0.05)
    assert first.server_prefix_cache_hit_rate == 0  # the warm-up's own prompt: nothing measured was cached
    assert other.server_prefix_cache_hit_rate == 0  # another level, other prompts
    # A repeat of a level finds its prompts cached, unless the server lets the level reset its cache first.
    assert again.server_prefix_cache_hit_rate == (0 if resets else pytest.approx(1.0))


def test_a_blocked_event_loop_is_measured_as_lag():
    async def blocked() -> list[float]:
        lags: list[float] = []
        watcher = asyncio.create_task(_watch_loop(lags))
        await asyncio.sleep(0.02)
        time.sleep(0.05)  # what a client parsing on one core does to every timestamp
        await asyncio.sleep(0.02)
        watcher.cancel()
        return lags

    lags = asyncio.run(blocked())
    assert max(lags) >= 0.045
    row = summarize(1, _run([_ok(start_s=0, e2e_s=1, ttft_s=0.1, output_tokens=2)], lags=lags),
                    SPEC)
    assert row.client_loop_lag_p99_ms > SPEC.max_loop_lag_ms and "client-limited" in row.flags


def test_sweep_stops_when_a_level_adds_too_little_throughput_and_names_the_knee():
    throughput = {1: 80.0, 2: 150.0, 4: 155.0, 8: 300.0}
    spec = SPEC.model_copy(update=dict(concurrency_levels=[1, 2, 4, 8]))
    stops: list[str] = []
    rows = sweep(spec, lambda c: level_result(c, throughput[c]), stops.append)
    assert [r.concurrency for r in rows] == [1, 2, 4]
    assert stops == [stop_reason(rows, 0.05)] and "saturated at concurrency 4" in stops[0]
    assert knee(rows).concurrency == 4
    every = sweep(spec.model_copy(update=dict(min_throughput_gain=None)), lambda c: level_result(c, throughput[c]))
    assert len(every) == 4  # sweeping every level was asked for
    # Throughput that fell is said as such, not as "less than 5% more".
    fell = [level_result(1, 80.0), level_result(2, 3599.0), level_result(4, 1997.0)]
    assert stop_reason(fell, 0.05) == ("saturated at concurrency 4: output throughput fell to 1,997 tok/s "
                                       "from 3,599 at 2")


def test_sweep_stops_when_the_slo_breaks_and_the_knee_stays_within_it():
    rows = [level_result(1, 80.0, 8, within_slo=True, slo_attainment=1.0), level_result(2, 150.0, 8, within_slo=True,
                                                                            slo_attainment=1.0),
            level_result(4, 290.0, 8, within_slo=False, slo_attainment=0.5)]
    assert "SLO missed at concurrency 4 (50% of requests within)" == stop_reason(rows, 0.05)
    assert knee(rows).concurrency == 2


def test_a_level_without_a_steady_state_is_no_knee_beside_steady_ones():
    rows = [level_result(1, 80.0), level_result(2, 150.0), level_result(4, 160.0).model_copy(update=dict(steady=False))]
    assert knee(rows).concurrency == 2  # 160 tok/s there includes its fill and drain
    assert knee(rows[2:]).concurrency == 4  # the only level measured: still named


def test_a_level_where_every_request_failed_is_reported_and_ends_the_sweep(tmp_path):
    refused = RequestRecord(ok=False, start_s=0, e2e_s=0.01, error="HTTP500", message="HTTP500: engine dead")
    good = summarize(1, _run([_ok(start_s=0, e2e_s=0.5, ttft_s=0.05, itl_s=[0.01], prompt_tokens=8,
                                            output_tokens=2)]), SPEC)
    dead = summarize(2, _run([refused] * 4), SPEC)
    assert dead.completed == 0 and dead.output_throughput == 0 and "all-failed" in dead.flags
    assert dead.first_error == "HTTP500: engine dead"
    assert stop_reason([good, dead], 0.05) == "every request failed at concurrency 2: HTTP500: engine dead"
    chart = save_results([good, dead], tmp_path, "t", facts={}, stop=stop_reason([good, dead], 0.05))
    assert chart.read_bytes().startswith(b"\x89PNG")  # drawn from the level that has figures
    assert "every request failed at concurrency 2" in (tmp_path / "summary.md").read_text()
    assert save_results([dead], tmp_path / "none", "t", facts={}, stop=None) is None  # nothing to draw: still no error


def test_geometric_levels_end_at_the_maximum():
    assert geometric_levels(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert geometric_levels(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert geometric_levels(1) == [1]


class _Terminated(BaseException):
    pass


def test_sigterm_mid_level_reaches_the_handler_that_was_installed():
    # Prefect cancels a flow with SIGTERM, which its handler turns into an exception; on uvloop
    # that exception would vanish inside a loop callback and the flow would be SIGKILLed instead.
    def handler(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        spec = SPEC.model_copy(update=dict(output_len=2000, requests_per_level=2))  # ~20 s of stream
        with StreamingServer(ttft_s=0.01, itl_s=0.01) as server:
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
            started = time.monotonic()
            with pytest.raises(_Terminated):
                run_level(server.base_url, "fake", spec, concurrency=2, vocab_size=1000)
        assert time.monotonic() - started < 10
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


HEADLINE = {
    "output tok/s": lambda r: (r.output_throughput, r.output_throughput_ci),
    "median TTFT": lambda r: (r.ttft.median, r.ttft.median_ci),
    "median TPOT": lambda r: (r.tpot.median, r.tpot.median_ci),
    "median ITL": lambda r: (r.itl.median, r.itl.median_ci),
    "median E2E": lambda r: (r.e2el.median, r.e2el.median_ci),
}


@pytest.mark.repeatability
def test_intervals_hold_the_other_repeats_and_narrow_as_the_level_grows(tmp_path):
    widths = {}
    # Server and client on cores of their own, as the demo runs vLLM and the client: sharing them,
    # the "fixed-speed" server's own pace moved between repeats by more than any interval's width.
    server_cpus, client_cpus = server_and_client_cpus()
    with StreamingServer(ttft_s=0.03, itl_s=0.01, cpus=server_cpus) as server:
        for seconds in (1.0, 4.0):
            spec = SPEC.model_copy(update=dict(output_len=16, level_duration_s=seconds, requests_per_level=None,
                                               client_cpus=client_cpus))
            repeats = [run_level(server.base_url, "fake", spec, concurrency=8, vocab_size=1000, repeat=i,
                                 results_dir=tmp_path / f"{seconds}s-{i}") for i in range(10)]
            for name, figure in HEADLINE.items():
                inside = [figure(a)[1][0] <= figure(b)[0] <= figure(a)[1][1]
                          for a, b in itertools.permutations(repeats, 2)]
                # Where a 95% interval is right, another repeat's own estimate (as noisy as this one's)
                # falls inside it about 83% of the time (|X - Y| < 1.96 sigma, X - Y having sigma * sqrt 2),
                # so 85% failed CI by chance (75 of 90); an interval too narrow by half holds about 50%.
                assert sum(inside) >= 0.72 * len(inside), (name, seconds, [figure(r) for r in repeats])
            widths["output tok/s", seconds] = np.mean([r.output_throughput_ci[1] - r.output_throughput_ci[0]
                                                      for r in repeats])
            # The sampling part of a median's interval, before the client's timing floor (which no
            # level length lowers) is added: from each repeat's per-request TTFTs.
            ttfts = [json.loads((tmp_path / f"{seconds}s-{i}" / "level-c0008.json").read_text())["ttfts"]
                     for i in range(10)]
            widths["median TTFT", seconds] = np.mean([np.subtract(*Latency.of([[t] for t in ts]).median_ci[::-1])
                                                     for ts in ttfts])
    assert widths["output tok/s", 4.0] < widths["output tok/s", 1.0]
    assert widths["median TTFT", 4.0] < widths["median TTFT", 1.0]


def test_a_level_shorter_than_a_request_has_no_window_and_says_so():
    def request(start_s: float) -> RequestRecord:
        return _ok(start_s=start_s, e2e_s=0.3, ttft_s=0.1, itl_s=[0.1, 0.1], prompt_tokens=8, output_tokens=3)

    burst = [request(0.001 * i) for i in range(8)]  # all sent at once: fill and drain only
    row = summarize(8, LevelRun(burst, 0.31, 0.008, [], 0.01, ServerSamples()), SPEC)
    assert not row.steady and "no-steady-state" in row.flags and row.measured == 8
    assert row.output_throughput == pytest.approx(24 / 0.31)  # over the whole level, and flagged
    steady = [request(0.1 * i) for i in range(40)]  # a request every 100 ms for 4 s
    row = summarize(3, LevelRun(steady, 4.3, 4.0, [], 0.01, ServerSamples()), SPEC)
    assert row.steady and row.window_start == pytest.approx(0.4) and row.window == pytest.approx(3.2)
    assert row.measured == 32  # those sent within [0.4 s, 3.6 s)
    assert row.output_throughput == pytest.approx(30.0, rel=0.05)  # 3 tokens per 100 ms


def test_energy_over_the_window_gives_tokens_per_joule_and_throughput_per_gpu():
    from fake_nvml import FakeNvml

    from tasks.gpu import energy_meter

    spec = SPEC.model_copy(update=dict(level_duration_s=1.5, requests_per_level=None))
    with StreamingServer(ttft_s=0.02, itl_s=0.005) as server, energy_meter(8, FakeNvml(count=8, watts=300.0)) as meter:
        row = run_level(server.base_url, "fake", spec, concurrency=4, vocab_size=1000, energy=meter, gpus=8)
    assert row.steady and row.energy_j == pytest.approx(8 * 300.0 * row.window, rel=0.05)
    assert row.output_tokens_per_joule == pytest.approx(row.output_throughput * row.window / row.energy_j)
    assert row.output_throughput_per_gpu == pytest.approx(row.output_throughput / 8)
