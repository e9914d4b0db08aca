"""The answer check: probes scored, degeneration caught, drift against the last good deployment."""

from __future__ import annotations

import time

import pytest

from tasks.answers.check import (
    Probe,
    ProbeResult,
    _scored,
    ask,
    ask_parsers,
    degeneration,
    flip_p_value,
    flips,
    judge,
    load_probes,
)
from tasks.answers.load import check_under_load
from tasks.answers.server_check import check_answers
from tasks.answers.spec import AnswerSpec
from tasks.errors import UnusableInput
from testkit.openai_server import StreamingServer

SPEC = AnswerSpec()


def _results(outputs: list[str], expected: list[str] | None = None) -> list[ProbeResult]:
    expected = expected or [f" {i}" for i in range(len(outputs))]
    return [ProbeResult(prompt=f"p{i}", expected=e, output=o, correct=o.strip().startswith(e.strip()))
            for i, (o, e) in enumerate(zip(outputs, expected))]


def test_a_server_stuck_on_one_token_fails_even_on_a_first_deployment():
    with StreamingServer() as server:  # answers " t t t ..." to everything
        report = check_answers(server.base_url, "fake", SPEC)  # 16 probes, by completion and by chat
    assert not report.passed and report.last_good is None
    assert any("one token repeated" in p for p in report.problems)
    assert any("the same output for 32 of 32 different prompts" in p for p in report.problems)
    assert report.accuracy == 0 and report.perplexity is None  # no prompt logprobs from this server


def test_degeneration_is_named_whatever_the_answers():
    assert degeneration([" 1 2 3", " 4 5 6", " 7 8 9"]) == []
    assert degeneration(["", "", " 7"]) == ["2 of 3 outputs empty"]
    assert degeneration([" 5 6", " 5 6", " 5 6", " 1"]) == ["the same output for 3 of 4 different prompts: '5 6'"]
    assert "1 of 2 outputs one token repeated" in degeneration(["!!!!!!", " fine answer"])


def _judge(outputs: list[str], perplexity: float = 1.2, **drift):
    return judge(_results(outputs), perplexity=perplexity, thresholds=SPEC, **drift)


def test_drift_against_the_last_good_deployment():
    good = _judge([f" {i}" for i in range(10)])
    assert good.passed and good.accuracy == 1.0
    baseline = good.baseline
    # The same weights under a new commit: same answers, same perplexity.
    assert _judge([f" {i}" for i in range(10)], 1.25, last_good=baseline, same_weights=True).passed
    worse = _judge([f" {i}" for i in range(7)] + [" x", " y", " z"], last_good=baseline)
    assert "accuracy 70% against 100% for the last good deployment" in worse.problems
    confused = _judge([f" {i}" for i in range(10)], 3.0, last_good=baseline)
    assert confused.problems == ["perplexity 3 against 1.2 (x2.5, limit x1.5)"]
    changed = [f" {i}" for i in range(8)] + [" 8 and more", " 9 and more"]
    assert _judge(changed, last_good=baseline).passed  # another commit may word it otherwise
    same = _judge(changed, last_good=baseline, same_commit=True)
    assert same.problems == ["same commit, 2 of 10 greedy outputs changed"]
    assert same.results[8].last_good == " 8"  # shown side by side in the artifact


def test_a_flipped_probe_fails_under_the_same_weights_and_counts_beyond_chance_under_new_ones():
    baseline = _judge([f" {i}" for i in range(32)]).baseline  # 32 probes, all right
    two_flipped = [f" {i}" for i in range(30)] + [" x", " y"]  # 94%: inside the 80% floor and the 10-point drop
    assert flips(_judge(two_flipped, last_good=baseline).results) == (2, 0)
    assert _judge(two_flipped, last_good=baseline).passed  # new weights: 2 of 2 discordant, p = 0.25
    assert _judge(two_flipped, last_good=baseline, same_weights=True).problems == [
        "2 probes right for the last good deployment are wrong now, under the same weights"]
    # Of 60 probes, 5 flipped one way and none back: 92%, a drop inside 10 points, and beyond chance.
    five_flipped = [f" {i}" for i in range(55)] + [" a", " b", " c", " d", " e"]
    assert _judge(five_flipped, last_good=_judge([f" {i}" for i in range(60)]).baseline).problems == [
        "5 probes flipped from right to wrong and 0 from wrong to right against the last good deployment "
        "(exact McNemar p=0.031, below 0.05)"]
    # Flips both ways under new weights: the net is noise.
    mixed = _judge([f" {i}" for i in range(27)] + [" a", " b", " c", " d", " e"],
                   last_good=_judge([f" {i}" for i in range(22)] + [" v", " w", " x", " y", " z"]
                                    + [f" {i}" for i in range(27, 32)]).baseline)
    assert flips(mixed.results) == (5, 5) and mixed.passed
    assert flip_p_value(0, 0) == 1.0 and flip_p_value(3, 0) == 0.125 and abs(flip_p_value(6, 1) - 8 / 128) < 1e-12


def test_chat_answers_may_be_sentences_and_are_kept_apart_from_completions():
    assert _scored("The capital of France is Paris.", "Paris", chat=True)
    assert not _scored("The capital of France is Paris.", "Paris", chat=False)
    assert not _scored(" 23 24 25 26", " 44 45 46", chat=True) and not _scored("Lyon, not Paris", "Pari", chat=True)
    chat = ProbeResult(prompt="p0", expected=" 0", output="0", correct=True, chat=True)
    report = judge([*_results([" 0"]), chat], perplexity=None, thresholds=SPEC)
    assert report.outputs == {"p0": " 0", "[chat] p0": "0"}


def test_probes_file_errors_name_the_file_and_line(tmp_path):
    probes = tmp_path / "probes.jsonl"
    probes.write_text('{"prompt": "1 2 3", "expected": " 4"}\n{"prompt": "no answer"}\n')
    with pytest.raises(UnusableInput, match=rf"answer_probes {probes}, line 2"):
        load_probes(probes)
    with pytest.raises(UnusableInput, match="answer_probes .*missing"):
        load_probes(tmp_path / "missing.jsonl")


COUNTING = [Probe(prompt=f"{a} {a + 1} {a + 2}", expected=f" {a + 3} {a + 4} {a + 5}") for a in range(0, 24, 3)]


@pytest.mark.parametrize("degenerates", [False, True])
def test_a_server_that_degenerates_with_a_full_kv_cache_fails_under_load_only(degenerates):
    # 20 slots of 1024 tokens; long requests stream 256 tokens at 20 ms each, long enough to ask under.
    spec = AnswerSpec(chat=False, max_tokens=3)
    with StreamingServer(ttft_s=0.05, itl_s=0.02, slots=20, counting=True,
                         degenerate_above=0.9 if degenerates else None) as server:
        idle = ask(server.base_url, "fake", COUNTING, max_tokens=3)
        assert all(r.correct for r in idle)  # idle, it answers right either way
        loaded = check_under_load(server.base_url, "fake", COUNTING, idle=idle, max_model_len=1024, vocab_size=1000,
                                  max_tokens=3, target=spec.load_target)
    assert loaded.fills == 19 and loaded.kv_usage >= 0.9 and not loaded.skipped
    if degenerates:
        assert loaded.problems == ["the same output for 8 of 8 different prompts: '!!!' with the KV cache 95% full",
                                   "8 of 8 probes right when idle are wrong with the KV cache 95% full, for example "
                                   "'0 1 2' -> '!!!'"]
    else:
        assert loaded.problems == [] and all(r.correct for r in loaded.results)


def test_under_load_is_skipped_and_said_where_the_server_reports_no_kv_cache():
    with StreamingServer(counting=True) as server:  # no slots: no cache_config_info
        loaded = check_under_load(server.base_url, "fake", COUNTING, idle=[], max_model_len=1024, vocab_size=1000)
    assert loaded.skipped == "the server reports no KV cache size (vllm:cache_config_info)" and loaded.problems == []


@pytest.mark.parametrize("parsers", ["parsed", "raw"])
def test_each_parser_the_server_runs_is_asked_once_and_raw_markup_fails(parsers):
    with StreamingServer(counting=True, parsers=parsers) as server:
        results, problems = ask_parsers(server.base_url, "fake", tools=True, reasoning=True)
    assert [r.prompt.split("]")[0] + "]" for r in results] == ["[tools]", "[reasoning]"]
    if parsers == "parsed":
        assert problems == [] and all(r.correct for r in results)
        assert results[0].output == 'get_weather({"city": "Paris"})'
    else:  # the markup reached the client: no tool call, no reasoning apart
        assert problems == [
            "the tool-call parser gave back no get_weather call with a city: "
            "'<|tool_calls_section_begin|><|tool_call_begin|>functions.get'",
            "the reasoning parser gave back no reasoning apart from the answer: "
            "'<think>17 + 25: 17 + 20 is 37, and 5 more is 42.</think>42'"]


def test_under_load_is_not_tried_where_max_num_seqs_cannot_fill_the_cache():
    # 20 slots of 1024 tokens, and a server that runs 2 sequences at once: 2 x 1024 of 20,480 tokens.
    with StreamingServer(ttft_s=0.05, itl_s=0.02, slots=20, counting=True) as server:
        started = time.monotonic()
        loaded = check_under_load(server.base_url, "fake", COUNTING, idle=[], max_model_len=1024, vocab_size=1000,
                                  max_num_seqs=2)
        assert time.monotonic() - started < 5  # no long request queued behind two running ones until a timeout
    assert loaded.skipped == ("at most 2 sequences run at once (max_num_seqs): 2 x 1024 tokens fill 10% of the KV "
                              "cache, short of 90%") and loaded.fills == 0 and loaded.problems == []


def test_the_reference_text_token_by_token_sees_a_worse_model_and_passes_a_changed_one():
    """Issue 39's blind spot: a damage that leaves the probes' first answers right and the reference
    perplexity under its 1.5x limit still makes most of the reference's tokens less likely than for
    the last good deployment; a retrained model makes as many more likely as less; a re-publish none."""
    from tasks.answers.check import AnswerBaseline, judge
    from tasks.answers.spec import AnswerSpec

    old = [0.5 + 0.01 * (i % 7) for i in range(60)]
    last_good = AnswerBaseline(accuracy=1.0, perplexity=1.7, repeated_ngrams=0.0, outputs={}, reference_nll=old)
    results = [ProbeResult(prompt="41 42 43", expected=" 44 45 46", output=" 44 45 46", correct=True)]

    def verdict(new):
        return judge(results, perplexity=1.7, reference_nll=new, thresholds=AnswerSpec(), last_good=last_good).problems

    damaged = [v + (0.15 if i % 10 else -0.05) for i, v in enumerate(old)]  # x1.14 perplexity, 54 of 60 worse
    [line] = verdict(damaged)
    assert line.startswith("the reference text's tokens are less likely than for the last good deployment: 54 of 60 "
                           "tokens less likely, 6 more (sign test p=")
    assert verdict(list(old)) == []  # a re-publish: every pair tied
    assert verdict([v + (0.3 if i % 2 else -0.25) for i, v in enumerate(old)]) == []  # retrained: both ways
    assert verdict([v + 0.01 for v in old]) == []  # a shift below the effect floor (x1.01), however sure
    assert verdict(damaged[:-1]) == []  # another tokenization (a new vocabulary): nothing to pair
