"""The whole answer check against a running server: the probes by completion and by chat, the
reference's perplexity, the parsers, and the probes again under load, judged against the last good
deployment. Its parts are tasks/answers/check.py (probes, asking, the verdict) and
tasks/answers/load.py (the same probes with the KV cache filled)."""

from __future__ import annotations

from tasks.answers.check import (
    BUILTIN_PROBES,
    BUILTIN_REFERENCE,
    AnswerBaseline,
    AnswerReport,
    ChatModes,
    ask,
    ask_parsers,
    judge,
    load_probes,
    perplexity_of,
    token_nll,
)
from tasks.answers.load import check_under_load
from tasks.answers.spec import AnswerSpec


def check_answers(base_url: str, model: str, spec: AnswerSpec, *, last_good: AnswerBaseline | None = None,
                  same_commit: bool = False, same_weights: bool = False, api_key: str | None = None,
                  max_model_len: int | None = None, vocab_size: int | None = None, tools: bool = False,
                  reasoning: bool = False, max_num_seqs: int | None = None,
                  modes: ChatModes | None = None) -> AnswerReport:
    """The whole check against a running server; the caller raises on `not report.passed`. With
    `spec.chat` the probes are asked a second time through /v1/chat/completions, in the model's
    served chat template: the path its users take, where a template that loses their message
    changes every answer while completions stay right. With `tools` or `reasoning` (the server's
    tool-call or reasoning parser), one probe through each parser. `modes`: the chat template's
    switch, where the model has one: the probes asked in instant mode, the reasoning probe thinking."""
    modes = modes or ChatModes()
    probes = load_probes(spec.probes) if spec.probes else BUILTIN_PROBES
    results = ask(base_url, model, probes, api_key=api_key, max_tokens=spec.max_tokens)
    if spec.chat:
        results += ask(base_url, model, probes, api_key=api_key, max_tokens=spec.max_tokens, chat=True,
                       chat_template_kwargs=modes.instant)
    nll = token_nll(base_url, model, spec.reference_text or BUILTIN_REFERENCE, api_key=api_key)
    report = judge(results, perplexity=perplexity_of(nll), reference_nll=nll, thresholds=spec, last_good=last_good,
                   same_commit=same_commit, same_weights=same_weights)
    if tools or reasoning:  # judged on their own: a parser is right or wrong, not a share of the probes
        parsed, problems = ask_parsers(base_url, model, tools=tools, reasoning=reasoning, api_key=api_key,
                                       max_tokens=spec.reasoning_max_tokens, modes=modes)
        report = report.model_copy(update={"results": report.results + parsed,
                                           "problems": report.problems + problems})
    if spec.under_load and max_model_len and vocab_size:
        loaded = check_under_load(base_url, model, probes, idle=results, max_model_len=max_model_len,
                                  vocab_size=vocab_size, max_tokens=spec.max_tokens, target=spec.load_target,
                                  api_key=api_key, max_num_seqs=max_num_seqs)
        report = report.model_copy(update={"under_load": loaded, "problems": report.problems + loaded.problems})
    return report
