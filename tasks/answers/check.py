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
import re
from pathlib import Path

from openai import APIError, OpenAI
from pydantic import BaseModel

from tasks.answers.reference import one_sided_p, reference_drift
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


# A model repo may ship its own probes (answer-probes.jsonl): read to a bound, since each probe is
# asked one by one, by completion and by chat, and again under load (a thread each): 100,000 took hours.
MAX_PROBES = 256
MAX_PROBES_BYTES = 1024 * 1024


def load_probes(path: Path) -> list[Probe]:
    """A JSONL file of {"prompt": ..., "expected": ...}; a bad line is named by its number. At most
    MAX_PROBES probes in MAX_PROBES_BYTES, and an expected answer that is not blank: "" starts
    every output, and would pass any model."""
    probes = []
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_PROBES_BYTES + 1)
        lines = data.decode().splitlines()
    except OSError as exc:
        raise UnusableInput(f"answer_probes {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UnusableInput(f"answer_probes {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if len(data) > MAX_PROBES_BYTES:
        raise UnusableInput(f"answer_probes {path}: more than {MAX_PROBES_BYTES:,} bytes; a probe set is at most "
                            f"{MAX_PROBES} probes")
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                probe = Probe.model_validate(json.loads(line))
            except ValueError as exc:
                raise UnusableInput(f"answer_probes {path}, line {number}: not {{\"prompt\", \"expected\"}} "
                                    f"({str(exc).splitlines()[0]})") from exc
            if not probe.expected.strip() or not probe.prompt:
                raise UnusableInput(f"answer_probes {path}, line {number}: an empty prompt or expected answer "
                                    "(a blank expected answer passes any output)")
            probes.append(probe)
            if len(probes) > MAX_PROBES:
                raise UnusableInput(f"answer_probes {path}: more than {MAX_PROBES} probes (line {number})")
    if not probes:
        raise UnusableInput(f"answer_probes {path}: no probes")
    return probes


class ProbeResult(BaseModel):
    prompt: str
    expected: str
    output: str
    correct: bool
    last_good: str | None = None  # the last good deployment's output for the same prompt
    chat: bool = False  # asked through /v1/chat/completions as the user's message
    out_of_budget: bool = False  # max_tokens ran out while the model still reasoned: no answer to score


    @property
    def key(self) -> str:
        """The probe's name in a baseline's outputs: a chat probe is told from its completion twin."""
        return f"[chat] {self.prompt}" if self.chat else self.prompt


class ChatModes(BaseModel):
    """How the model's chat template turns thinking off and on (`chat_template_kwargs`, from its
    family's profile): the probes are asked `instant`, the reasoning probe `thinking`. None: the
    template's default, for a model with no switch."""

    instant: dict | None = None
    thinking: dict | None = None


class AnswerBaseline(BaseModel):
    """What a deployment's answers were, kept in its history record: the next one's drift baseline."""

    accuracy: float
    perplexity: float | None  # of the reference text; None where the server returns no prompt logprobs
    repeated_ngrams: float  # share of the outputs' word 3-grams that repeat an earlier one
    outputs: dict[str, str]  # ProbeResult.key -> greedy output
    # The reference text's tokens' negative log-probabilities (after the first): the next check's pairs.
    reference_nll: list[float] | None = None


class LoadedAnswers(BaseModel):
    """The probes' answers while the KV cache was full, and what was wrong with them."""

    target: float  # the KV cache usage the probes waited for
    kv_usage: float | None  # the highest usage seen while the probes were asked
    fills: int  # long requests streamed to fill the cache
    results: list[ProbeResult] = []
    problems: list[str] = []
    skipped: str = ""  # why the probes were not asked under load


class AnswerReport(AnswerBaseline):
    results: list[ProbeResult]
    last_good: AnswerBaseline | None = None
    problems: list[str] = []
    under_load: LoadedAnswers | None = None  # None: not asked (off, or nothing to fill the cache with)

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def baseline(self) -> AnswerBaseline:
        return AnswerBaseline(accuracy=self.accuracy, perplexity=self.perplexity,
                              repeated_ngrams=self.repeated_ngrams, outputs=self.outputs,
                              reference_nll=self.reference_nll)


def _correct(output: str | None, expected: str) -> bool:
    return output is not None and output.strip().lower().startswith(expected.strip().lower())


def _scored(output: str | None, expected: str, *, chat: bool) -> bool:
    """A chat model may answer in a sentence ("The capital of France is Paris."): there the expected
    answer as a whole word anywhere in the reply's first line counts, as well as at its start."""
    if output is None or not chat:
        return _correct(output, expected)
    first = output.strip().splitlines()[0].lower() if output.strip() else ""
    return _correct(output, expected) or re.search(rf"(?<!\w){re.escape(expected.strip().lower())}(?!\w)",
                                                   first) is not None


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


def flips(results: list[ProbeResult]) -> tuple[int, int]:
    """(right for the last good deployment and wrong now, wrong then and right now), over the probes
    both were asked: the paired outcomes, the strongest signal the check has."""
    paired = [(_scored(r.last_good, r.expected, chat=r.chat), r.correct) for r in results if r.last_good is not None]
    return sum(then and not now for then, now in paired), sum(now and not then for then, now in paired)


def flip_p_value(worse: int, better: int) -> float:
    """One-sided exact McNemar test: the chance of `worse` or more right-to-wrong flips among
    `worse + better` discordant probes if either direction were as likely (binomial, p = 1/2)."""
    return one_sided_p(worse, better)


def judge(results: list[ProbeResult], *, perplexity: float | None, thresholds: AnswerSpec,
          last_good: AnswerBaseline | None = None, same_commit: bool = False,
          same_weights: bool = False, reference_nll: list[float] | None = None) -> AnswerReport:
    """The verdict: absolute checks always, drift where a last good deployment of the model exists.

    A probe the last good deployment answered right and this one answers wrong fails the check
    outright under the same weights (same commit, or a re-publish of the same weight files): greedy
    decoding of the same numbers has no noise to hide in. Under new weights some probes flip either
    way by chance, so the flips fail only when right-to-wrong outnumber wrong-to-right beyond chance
    (exact McNemar, one-sided, at `max_flip_p`): a new model as good as the last one fails this at
    most that often, and one unchanged never does. A probe whose tokens ran out while the model was
    still reasoning has no answer: it is left out of the scores and named as the budget it is."""
    cut = [r for r in results if r.out_of_budget]
    results = [r for r in results if not r.out_of_budget]
    budget = [f"{len(cut)} chat probes spent their {thresholds.max_tokens} tokens reasoning and gave no answer: the "
              "template thinks by default (asked in instant mode where the model's family has a switch) or "
              "answers.max_tokens is too small"] if cut else []
    if not results:
        return AnswerReport(results=cut, accuracy=0.0, perplexity=perplexity, repeated_ngrams=0.0, outputs={},
                            last_good=last_good, problems=budget, reference_nll=reference_nll)
    outputs = [r.output for r in results]
    accuracy = sum(r.correct for r in results) / len(results)
    repeated = _repeated_ngrams(outputs)
    problems = budget + degeneration(outputs)
    if accuracy < thresholds.min_accuracy:
        problems.append(f"accuracy {accuracy:.0%} below {thresholds.min_accuracy:.0%}")
    if last_good is not None:
        results = [r.model_copy(update={"last_good": last_good.outputs.get(r.key)}) for r in results]
        if accuracy < last_good.accuracy - thresholds.max_accuracy_drop:
            problems.append(f"accuracy {accuracy:.0%} against {last_good.accuracy:.0%} for the last good deployment")
        worse, better = flips(results)
        p_value = flip_p_value(worse, better)
        if worse and (same_commit or same_weights):
            problems.append(f"{worse} probes right for the last good deployment are wrong now, under the same weights")
        elif worse > better and p_value < thresholds.max_flip_p:
            problems.append(f"{worse} probes flipped from right to wrong and {better} from wrong to right against "
                            f"the last good deployment (exact McNemar p={p_value:.3f}, "
                            f"below {thresholds.max_flip_p:g})")
        if perplexity and last_good.perplexity and perplexity > last_good.perplexity * thresholds.max_perplexity_ratio:
            problems.append(f"perplexity {perplexity:.3g} against {last_good.perplexity:.3g} "
                            f"(x{perplexity / last_good.perplexity:.1f}, limit x{thresholds.max_perplexity_ratio:g})")
        if drift := reference_drift(reference_nll, last_good.reference_nll, max_p=thresholds.max_reference_p,
                                    min_change=thresholds.min_reference_change):
            problems.append(drift)
        if repeated > max(2 * last_good.repeated_ngrams, 0.2):
            problems.append(f"{repeated:.0%} repeated 3-grams against {last_good.repeated_ngrams:.0%}")
        compared = [r for r in results if r.last_good is not None]
        changed = sum(r.output != r.last_good for r in compared)
        if same_commit and compared and changed / len(compared) > thresholds.max_changed_outputs:
            problems.append(f"same commit, {changed} of {len(compared)} greedy outputs changed")
    return AnswerReport(results=results + cut, accuracy=accuracy, perplexity=perplexity, repeated_ngrams=repeated,
                        outputs={r.key: r.output for r in results}, last_good=last_good, problems=problems,
                        reference_nll=reference_nll)


def _client(base_url: str, api_key: str | None, timeout_s: float) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "EMPTY", max_retries=2, timeout=timeout_s)


def _thinking_only(done) -> bool:
    """A chat reply whose tokens ran out inside the reasoning: no content, a thought, cut by length."""
    if not done.choices:
        return False
    choice = done.choices[0]
    extra = choice.message.model_extra or {}
    thought = extra.get("reasoning") or extra.get("reasoning_content") or ""
    return choice.finish_reason == "length" and not (choice.message.content or "").strip() and bool(thought.strip())


def ask(base_url: str, model: str, probes: list[Probe], *, api_key: str | None = None, max_tokens: int = 16,
        timeout_s: float = 120.0, chat: bool = False, chat_template_kwargs: dict | None = None) -> list[ProbeResult]:
    """Each probe's greedy answer: a completion of its prompt, or with `chat` the reply to it as a
    user's message through the chat template vLLM serves (with `chat_template_kwargs`, e.g. Kimi's
    instant mode). A server that refuses is an AnswerCheckFailed in its words."""
    client = _client(base_url, api_key, timeout_s)
    extra_body = {"chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else None
    results = []
    for probe in probes:
        thinking_only = False
        try:
            if chat:
                done = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0.0,
                                                      messages=[{"role": "user", "content": probe.prompt}],
                                                      extra_body=extra_body)
                output = (done.choices[0].message.content or "") if done.choices else ""
                thinking_only = _thinking_only(done)
            else:
                done = client.completions.create(model=model, prompt=probe.prompt, max_tokens=max_tokens,
                                                 temperature=0.0)
                output = done.choices[0].text if done.choices else ""
        except APIError as exc:
            raise AnswerCheckFailed(f"{base_url} refused the {'chat' if chat else 'answer'} probe "
                                    f"{probe.prompt[:40]!r}: {str(exc).splitlines()[0]}") from exc
        results.append(ProbeResult(prompt=probe.prompt, expected=probe.expected, output=output, chat=chat,
                                   correct=_scored(output, probe.expected, chat=chat), out_of_budget=thinking_only))
    return results


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_PROMPT = "What is the weather in Paris right now? Use the get_weather tool."
REASONING_PROBE = Probe(prompt="What is 17 + 25? Think it through, then give the number.", expected="42")


def ask_parsers(base_url: str, model: str, *, tools: bool, reasoning: bool, api_key: str | None = None,
                max_tokens: int = 1024, timeout_s: float = 300.0,
                modes: ChatModes | None = None) -> tuple[list[ProbeResult], list[str]]:
    """One probe through each parser the server was started with: a tool call that must come back
    parsed (`tool_calls`, a get_weather call with a city), and a question whose reasoning must come
    back apart from its answer. A wrong parser leaves the model's raw markup in the content: the
    answers look fine to a completion probe and every client's tool call fails."""
    client = _client(base_url, api_key, timeout_s)
    modes = modes or ChatModes()
    results, problems = [], []
    try:
        if tools:
            done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": TOOL_PROMPT}],
                                                  tools=[WEATHER_TOOL], tool_choice="auto", temperature=0.0,
                                                  max_tokens=max_tokens)
            message = done.choices[0].message
            call = (message.tool_calls or [None])[0]
            try:
                city = str(json.loads(call.function.arguments).get("city", "")) if call else ""
            except (ValueError, AttributeError):
                city = ""
            parsed = call is not None and call.function.name == "get_weather" and city.lower().startswith("paris")
            output = f"{call.function.name}({call.function.arguments})" if call else (message.content or "")
            results.append(ProbeResult(prompt=f"[tools] {TOOL_PROMPT}", expected='get_weather({"city": "Paris"})',
                                       output=output, correct=parsed, chat=True))
            if not parsed:
                problems.append(f"the tool-call parser gave back no get_weather call with a city: {output[:60]!r}")
        if reasoning:
            done = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": REASONING_PROBE.prompt}], temperature=0.0,
                max_tokens=max_tokens, extra_body={"chat_template_kwargs": modes.thinking} if modes.thinking else None)
            if _thinking_only(done):  # the budget, not the answer: said as such
                results.append(ProbeResult(prompt=f"[reasoning] {REASONING_PROBE.prompt}", output="", correct=False,
                                           expected=REASONING_PROBE.expected, chat=True, out_of_budget=True))
                problems.append(f"the reasoning probe was still thinking when its {max_tokens} tokens ran out: no "
                                "answer to judge (answers.reasoning_max_tokens sizes the budget)")
                return results, problems
            message = done.choices[0].message
            extra = message.model_extra or {}
            thought = extra.get("reasoning") or extra.get("reasoning_content") or ""
            answer = message.content or ""
            right = bool(thought.strip()) and _scored(answer, REASONING_PROBE.expected, chat=True)
            results.append(ProbeResult(prompt=f"[reasoning] {REASONING_PROBE.prompt}",
                                       expected=REASONING_PROBE.expected, output=answer, correct=right, chat=True))
            if not thought.strip():
                problems.append(f"the reasoning parser gave back no reasoning apart from the answer: {answer[:60]!r}")
            elif not right:
                problems.append(f"the answer after the reasoning is wrong: {answer[:60]!r}")
    except APIError as exc:
        problems.append(f"{base_url} refused a parser probe: {str(exc).splitlines()[0]}")
    return results, problems


def token_nll(base_url: str, model: str, text: str, *, api_key: str | None = None,
              timeout_s: float = 120.0) -> list[float] | None:
    """The negative log-probability of each of the text's tokens after the first, from the server's
    prompt logprobs (vLLM: echo with logprobs); None where the server returns none."""
    try:
        done = _client(base_url, api_key, timeout_s).completions.create(
            model=model, prompt=text, max_tokens=1, temperature=0.0, echo=True, logprobs=0)
        logprobs = done.choices[0].logprobs.token_logprobs[1:done.usage.prompt_tokens]
    except (APIError, AttributeError, IndexError, TypeError):
        return None
    values = [-float(v) for v in logprobs if v is not None]
    return values or None


def perplexity(base_url: str, model: str, text: str, *, api_key: str | None = None,
               timeout_s: float = 120.0) -> float | None:
    """exp of the mean negative log-probability of the text's tokens after the first."""
    return perplexity_of(token_nll(base_url, model, text, api_key=api_key, timeout_s=timeout_s))


def perplexity_of(nll: list[float] | None) -> float | None:
    return math.exp(sum(nll) / len(nll)) if nll else None
