"""Does the new server answer right? Probe prompts with known answers, degeneration, and drift.

A server can pass /health, list its model and stream a token while emitting one repeated token
(vllm-project/vllm#40357) or "!!!!" (#42426), and garbage streams fast: a benchmark alone would
promote it. So, after readiness and before the sweep: greedy answers to probes with known answers,
scored; outputs checked for degeneration (empty, one token repeated, one output for different
prompts, a share of repeated n-grams far above the last good deployment's); and drift against the
last good deployment of the same model on this host (accuracy, perplexity of a fixed text from its
prompt logprobs, and for the same commit, the very same greedy outputs). A first deployment is
judged on the absolute checks alone.

lm-evaluation-harness could score the probes through its `local-completions` model, but it would
add its dependency tree to every host for a handful of greedy prompts and a perplexity, which are
two OpenAI calls each; this module makes them directly with the `openai` client.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

from openai import APIError, OpenAI
from pydantic import BaseModel

from tasks.answers.spec import AnswerSpec
from tasks.errors import AnswerCheckFailed, UnusableInput


class Probe(BaseModel):
    prompt: str
    expected: str  # the answer the output must start with, spaces and case aside


# For real models: short questions with one unambiguous answer, in a completion-friendly form.
BUILTIN_PROBES = [Probe(prompt=f"Question: {q}\nAnswer:", expected=a) for q, a in (
    ("What is 7 + 5?", "12"), ("What is 9 times 8?", "72"), ("What is 100 minus 37?", "63"),
    ("What is 144 divided by 12?", "12"), ("What is 15 + 27?", "42"), ("How many minutes are in an hour?", "60"),
    ("How many centimeters are in a meter?", "100"), ("How many days are in a week?", "7"),
    ("How many grams are in a kilogram?", "1000"), ("How many hours are in a day?", "24"),
    ("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
    ("What is the chemical symbol for gold?", "Au"), ("How many legs does a spider have?", "8"),
    ("What planet is closest to the Sun?", "Mercury"), ("In which continent is Kenya?", "Africa"),
)]
BUILTIN_REFERENCE = ("The quick brown fox jumps over the lazy dog. Water boils at one hundred degrees Celsius at sea "
                     "level, and the Earth turns once on its axis every day.")


def load_probes(path: Path) -> list[Probe]:
    """A JSONL file of {"prompt": ..., "expected": ...}; a bad line is named by its number."""
    probes = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UnusableInput(f"answer_probes {path}: {exc.strerror or exc}") from exc
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                probes.append(Probe.model_validate(json.loads(line)))
            except ValueError as exc:
                raise UnusableInput(f"answer_probes {path}, line {number}: not {{\"prompt\", \"expected\"}} "
                                    f"({str(exc).splitlines()[0]})") from exc
    if not probes:
        raise UnusableInput(f"answer_probes {path}: no probes")
    return probes


class ProbeResult(BaseModel):
    prompt: str
    expected: str
    output: str
    correct: bool
    last_good: str | None = None  # the last good deployment's output for the same prompt


class AnswerBaseline(BaseModel):
    """What a deployment's answers were, kept in its history record: the next one's drift baseline."""

    accuracy: float
    perplexity: float | None  # of the reference text; None where the server returns no prompt logprobs
    repeated_ngrams: float  # share of the outputs' word 3-grams that repeat an earlier one
    outputs: dict[str, str]  # prompt -> greedy output


class AnswerReport(AnswerBaseline):
    results: list[ProbeResult]
    last_good: AnswerBaseline | None = None
    problems: list[str] = []

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def baseline(self) -> AnswerBaseline:
        return AnswerBaseline(accuracy=self.accuracy, perplexity=self.perplexity,
                              repeated_ngrams=self.repeated_ngrams, outputs=self.outputs)


def _correct(output: str, expected: str) -> bool:
    return output.strip().lower().startswith(expected.strip().lower())


def _repeated_ngrams(outputs: list[str], n: int = 3) -> float:
    grams = [tuple(words[i:i + n]) for words in (o.split() for o in outputs) for i in range(len(words) - n + 1)]
    return sum(c - 1 for c in collections.Counter(grams).values()) / len(grams) if grams else 0.0


def _one_token_repeated(output: str) -> bool:
    """'t t t t', '!!!!', 'the the the': a stream stuck on one token."""
    words = output.split()
    return (len(words) >= 3 and len(set(words)) == 1) or (len(output.strip()) >= 4 and len(set(output.strip())) == 1)


def degeneration(outputs: list[str]) -> list[str]:
    """What is wrong with the outputs whatever the answers should be."""
    found, n = [], len(outputs)
    if empty := sum(not o.strip() for o in outputs):
        found.append(f"{empty} of {n} outputs empty")
    if stuck := sum(_one_token_repeated(o) for o in outputs):
        found.append(f"{stuck} of {n} outputs one token repeated")
    common, count = collections.Counter(o.strip() for o in outputs).most_common(1)[0] if outputs else ("", 0)
    if n > 1 and common and count > n / 2:
        found.append(f"the same output for {count} of {n} different prompts: {common[:40]!r}")
    return found


def judge(results: list[ProbeResult], perplexity: float | None, thresholds: AnswerSpec,
          last_good: AnswerBaseline | None, same_commit: bool) -> AnswerReport:
    """The verdict: absolute checks always, drift where a last good deployment of the model exists."""
    outputs = [r.output for r in results]
    accuracy = sum(r.correct for r in results) / len(results)
    repeated = _repeated_ngrams(outputs)
    problems = degeneration(outputs)
    if accuracy < thresholds.min_accuracy:
        problems.append(f"accuracy {accuracy:.0%} below {thresholds.min_accuracy:.0%}")
    if last_good is not None:
        results = [r.model_copy(update={"last_good": last_good.outputs.get(r.prompt)}) for r in results]
        if accuracy < last_good.accuracy - thresholds.max_accuracy_drop:
            problems.append(f"accuracy {accuracy:.0%} against {last_good.accuracy:.0%} for the last good deployment")
        if perplexity and last_good.perplexity and perplexity > last_good.perplexity * thresholds.max_perplexity_ratio:
            problems.append(f"perplexity {perplexity:.3g} against {last_good.perplexity:.3g} "
                            f"(x{perplexity / last_good.perplexity:.1f}, limit x{thresholds.max_perplexity_ratio:g})")
        if repeated > max(2 * last_good.repeated_ngrams, 0.2):
            problems.append(f"{repeated:.0%} repeated 3-grams against {last_good.repeated_ngrams:.0%}")
        compared = [r for r in results if r.last_good is not None]
        changed = sum(r.output != r.last_good for r in compared)
        if same_commit and compared and changed / len(compared) > thresholds.max_changed_outputs:
            problems.append(f"same commit, {changed} of {len(compared)} greedy outputs changed")
    return AnswerReport(results=results, accuracy=accuracy, perplexity=perplexity, repeated_ngrams=repeated,
                        outputs={r.prompt: r.output for r in results}, last_good=last_good, problems=problems)


def check_answers(base_url: str, model: str, spec: AnswerSpec, last_good: AnswerBaseline | None = None,
                  same_commit: bool = False, api_key: str | None = None) -> AnswerReport:
    """The whole check against a running server; the caller raises on `not report.passed`."""
    probes = load_probes(spec.probes) if spec.probes else BUILTIN_PROBES
    results = ask(base_url, model, probes, api_key, spec.max_tokens)
    return judge(results, perplexity(base_url, model, spec.reference_text or BUILTIN_REFERENCE, api_key), spec,
                 last_good, same_commit)


def _client(base_url: str, api_key: str | None, timeout_s: float) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "EMPTY", max_retries=2, timeout=timeout_s)


def ask(base_url: str, model: str, probes: list[Probe], api_key: str | None = None, max_tokens: int = 16,
        timeout_s: float = 120.0) -> list[ProbeResult]:
    """Each probe's greedy completion; a server that refuses is an AnswerCheckFailed in its words."""
    client = _client(base_url, api_key, timeout_s)
    results = []
    for probe in probes:
        try:
            done = client.completions.create(model=model, prompt=probe.prompt, max_tokens=max_tokens, temperature=0.0)
        except APIError as exc:
            raise AnswerCheckFailed(f"{base_url} refused the answer probe {probe.prompt[:40]!r}: "
                                    f"{str(exc).splitlines()[0]}") from exc
        output = done.choices[0].text if done.choices else ""
        results.append(ProbeResult(prompt=probe.prompt, expected=probe.expected, output=output,
                                   correct=_correct(output, probe.expected)))
    return results


def perplexity(base_url: str, model: str, text: str, api_key: str | None = None,
               timeout_s: float = 120.0) -> float | None:
    """exp of the mean negative log-probability of the text's tokens after the first, from the
    server's prompt logprobs (vLLM: echo with logprobs); None where the server returns none."""
    try:
        done = _client(base_url, api_key, timeout_s).completions.create(
            model=model, prompt=text, max_tokens=1, temperature=0.0, echo=True, logprobs=0)
        logprobs = done.choices[0].logprobs.token_logprobs[1:done.usage.prompt_tokens]
    except (APIError, AttributeError, IndexError, TypeError):
        return None
    values = [v for v in logprobs if v is not None]
    return math.exp(-sum(values) / len(values)) if values else None
