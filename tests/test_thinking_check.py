"""The answer check on a thinking model (issue 39), against a server that answers as vLLM does with
Kimi-K2.5's template and the kimi_k2 parsers: the template thinks unless `chat_template_kwargs`
says `{"thinking": false}`, the reasoning comes back apart from the content, and a budget spent
inside the thought leaves the content empty with finish_reason "length". No vLLM: the rules are
what is tested here; the tiny Kimi-K2.5 served by vLLM is issue 39's other half."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tasks.answers.check import ChatModes, Probe
from tasks.answers.server_check import check_answers
from tasks.answers.spec import AnswerSpec
from testkit.json_reply import send_json

PROBES = [Probe(prompt=f"{n} {n + 1} {n + 2}", expected=f"{n + 3} {n + 4}") for n in range(10, 30, 2)]
THOUGHT_TOKENS = 40  # what the fake model thinks before it answers, in tokens


def _answer(prompt: str) -> str:
    if prompt.startswith("What is 17 + 25"):
        return "42"
    if not prompt.split()[-1].isdigit():  # the reference text, asked for its perplexity
        return " and"
    last = int(prompt.split()[-1])
    return f" {last + 1} {last + 2} {last + 3}"


class _Kimi(BaseHTTPRequestHandler):
    """Completions continue the count; chat thinks first unless told not to."""

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        budget = int(body.get("max_tokens") or 16)
        if self.path.endswith("/completions") and "chat" not in self.path:
            choice = {"index": 0, "text": _answer(body["prompt"]), "finish_reason": "length", "logprobs": None}
            return self._send({"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
        prompt = body["messages"][-1]["content"]
        thinking = (body.get("chat_template_kwargs") or {}).get("thinking", True)
        message = {"role": "assistant", "content": None, "reasoning": None}
        finish = "stop"
        if body.get("tools"):
            message["tool_calls"] = [{"id": "functions.get_weather:0", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]
            finish = "tool_calls"
        elif thinking and budget < THOUGHT_TOKENS + 3:
            message["reasoning"] = " ".join(["hmm"] * min(budget, THOUGHT_TOKENS))
            finish = "length"
        else:
            message["reasoning"] = " ".join(["hmm"] * THOUGHT_TOKENS) if thinking else None
            message["content"] = _answer(prompt)
        self._send({"choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": min(budget, THOUGHT_TOKENS + 3)}})

    def _send(self, payload: dict) -> None:
        send_json(self, {"id": "x", "object": "chat.completion", "created": 0, "model": "kimi", **payload})

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def kimi():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Kimi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


KIMI_MODES = ChatModes(instant={"thinking": False}, thinking={"thinking": True})
SPEC = AnswerSpec(under_load=False)


def _check(base_url: str, spec: AnswerSpec = SPEC, modes: ChatModes | None = KIMI_MODES):
    import tasks.answers.server_check as server_check

    original = server_check.load_probes
    server_check.load_probes = lambda path: PROBES
    try:
        return check_answers(base_url, "kimi", spec.model_copy(update={"probes": "probes.jsonl"}), tools=True,
                             reasoning=True, modes=modes)
    finally:
        server_check.load_probes = original


def test_probes_in_instant_mode_the_reasoning_probe_thinking_and_the_tool_call_parsed_back(kimi):
    report = _check(kimi)
    assert report.passed, report.problems
    chat = [r for r in report.results if r.chat and not r.prompt.startswith("[")]
    assert len(chat) == len(PROBES) and all(r.correct for r in chat)  # instant: answered within 16 tokens
    reasoning = next(r for r in report.results if r.prompt.startswith("[reasoning]"))
    tool = next(r for r in report.results if r.prompt.startswith("[tools]"))
    assert reasoning.correct and reasoning.output == "42"
    assert tool.correct and tool.output == 'get_weather({"city": "Paris"})'


def test_a_budget_too_small_for_the_thought_is_reported_as_the_budget_not_as_wrong_answers(kimi):
    report = _check(kimi, SPEC.model_copy(update={"reasoning_max_tokens": 24}))
    assert report.problems == ["the reasoning probe was still thinking when its 24 tokens ran out: no answer to "
                               "judge (answers.reasoning_max_tokens sizes the budget)"]
    assert next(r for r in report.results if r.prompt.startswith("[reasoning]")).out_of_budget
    # Without the instant switch every chat probe thinks past its 16 tokens: named as that, and the
    # completion probes are still scored (all right), not "accuracy below 80%" nor "outputs empty".
    report = _check(kimi, modes=None)
    assert report.problems[0].startswith(f"{len(PROBES)} chat probes spent their 16 tokens reasoning and gave no "
                                         "answer"), report.problems
    assert report.accuracy == 1.0 and not any("accuracy" in p or "empty" in p for p in report.problems)
