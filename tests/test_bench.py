"""Metric definitions, checked on records whose timings are known."""

import pytest

from fake_openai import DelayServer

from tasks.bench import RequestRecord, make_prompts, run_level, saturated, summarize


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = RequestRecord(ok=True, e2e_s=1.0, ttft_s=0.1, itl_s=[0.1] * 9, prompt_tokens=5, output_tokens=10)
    assert r.tpot_s == pytest.approx(0.1)
    assert RequestRecord(ok=True, e2e_s=1.0, ttft_s=0.1, output_tokens=1).tpot_s is None


def test_summary_uses_server_token_counts_and_wall_time():
    records = [
        RequestRecord(ok=True, e2e_s=0.5, ttft_s=0.05, itl_s=[0.01, 0.02], prompt_tokens=64, output_tokens=32),
        RequestRecord(ok=True, e2e_s=0.7, ttft_s=0.15, itl_s=[0.03], prompt_tokens=64, output_tokens=32),
        RequestRecord(ok=False, e2e_s=0.1, error="APIConnectionError"),
    ]
    row = summarize(concurrency=2, records=records, duration_s=2.0)
    assert (row["requests"], row["completed"], row["failed"]) == (3, 2, 1)
    assert row["errors"] == "APIConnectionError=1"
    assert row["output_throughput"] == pytest.approx(32.0)
    assert row["total_token_throughput"] == pytest.approx(96.0)
    assert row["ttft_mean_ms"] == pytest.approx(100.0)
    assert row["itl_mean_ms"] == pytest.approx(20.0)
    assert row["tpot_mean_ms"] == pytest.approx(((0.45 / 31) + (0.55 / 31)) / 2 * 1000)


def test_prompts_are_exact_length_reproducible_and_avoid_vocab_ends():
    a = make_prompts(4, 128, vocab_size=163840, seed=7)
    assert a == make_prompts(4, 128, vocab_size=163840, seed=7)
    assert all(len(p) == 128 for p in a)
    assert min(min(p) for p in a) >= 100 and max(max(p) for p in a) < 163840 - 1000


@pytest.mark.parametrize("concurrency", [1, 32])
def test_measured_latencies_match_what_the_server_injected(concurrency):
    ttft, itl = 0.200, 0.020
    with DelayServer(ttft_s=ttft, itl_s=itl) as server:
        row = run_level(server.base_url, "fake", concurrency, num_requests=max(8, 2 * concurrency), input_len=16,
                        output_len=20, vocab_size=1000)
    assert row["failed"] == 0 and row["total_output_tokens"] == max(8, 2 * concurrency) * 20
    for metric, injected in (("ttft", ttft), ("tpot", itl), ("itl", itl)):
        measured = row[f"{metric}_median_ms"] / 1000
        assert abs(measured - injected) <= max(0.05 * injected, 0.002), (metric, measured, injected)


def test_sweep_stops_when_a_level_adds_too_little_throughput():
    rows = [{"concurrency": c, "output_throughput": t} for c, t in ((1, 80.0), (2, 150.0), (4, 155.0))]
    assert not saturated(rows[:1], 0.05)
    assert not saturated(rows[:2], 0.05)  # +87%
    assert saturated(rows, 0.05)  # +3%
    assert not saturated(rows, None)  # sweeping every level was asked for
