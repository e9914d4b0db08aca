"""The answer check: probes scored, degeneration caught, drift against the last good deployment."""

from __future__ import annotations

import pytest

from tasks.answers.check import (
    ProbeResult,
    check_answers,
    degeneration,
    judge,
    load_probes,
)
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
        report = check_answers(server.base_url, "fake", SPEC)
    assert not report.passed and report.last_good is None
    assert any("one token repeated" in p for p in report.problems)
    assert any("the same output for 16 of 16 different prompts" in p for p in report.problems)
    assert report.accuracy == 0 and report.perplexity is None  # no prompt logprobs from this server


def test_degeneration_is_named_whatever_the_answers():
    assert degeneration([" 1 2 3", " 4 5 6", " 7 8 9"]) == []
    assert degeneration(["", "", " 7"]) == ["2 of 3 outputs empty"]
    assert degeneration([" 5 6", " 5 6", " 5 6", " 1"]) == ["the same output for 3 of 4 different prompts: '5 6'"]
    assert "1 of 2 outputs one token repeated" in degeneration(["!!!!!!", " fine answer"])


def test_drift_against_the_last_good_deployment():
    good = judge(_results([f" {i}" for i in range(10)]), 1.2, SPEC, None, False)
    assert good.passed and good.accuracy == 1.0
    baseline = good.baseline
    # The same weights under a new commit: same answers, same perplexity.
    assert judge(_results([f" {i}" for i in range(10)]), 1.25, SPEC, baseline, False).passed
    worse = judge(_results([f" {i}" for i in range(7)] + [" x", " y", " z"]), 1.2, SPEC, baseline, False)
    assert "accuracy 70% against 100% for the last good deployment" in worse.problems
    confused = judge(_results([f" {i}" for i in range(10)]), 3.0, SPEC, baseline, False)
    assert confused.problems == ["perplexity 3 against 1.2 (x2.5, limit x1.5)"]
    changed = [f" {i}" for i in range(8)] + [" 8 and more", " 9 and more"]
    assert judge(_results(changed), 1.2, SPEC, baseline, False).passed  # another commit may word it otherwise
    same = judge(_results(changed), 1.2, SPEC, baseline, True)
    assert same.problems == ["same commit, 2 of 10 greedy outputs changed"]
    assert same.results[8].last_good == " 8"  # shown side by side in the artifact


def test_probes_file_errors_name_the_file_and_line(tmp_path):
    probes = tmp_path / "probes.jsonl"
    probes.write_text('{"prompt": "1 2 3", "expected": " 4"}\n{"prompt": "no answer"}\n')
    with pytest.raises(UnusableInput, match=rf"answer_probes {probes}, line 2"):
        load_probes(probes)
    with pytest.raises(UnusableInput, match="answer_probes .*missing"):
        load_probes(tmp_path / "missing.jsonl")
