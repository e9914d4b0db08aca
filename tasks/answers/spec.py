"""What the answer check asks and when it fails: part of the deploy form, light enough for the CLI."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

SHIPPED_PROBES = "answer-probes.jsonl"  # a probe set a model repo ships for its own answer check


class AnswerSpec(BaseModel):
    """The answer check's probes and thresholds; the UI shows them as one group of the deploy form."""

    enabled: bool = Field(True, description="Check the new server's answers after readiness, before the benchmark")
    probes: Path | None = Field(None, description="JSONL of {\"prompt\", \"expected\"}, a path in the model repo "
                                "or an absolute one; empty: the model's own answer-probes.jsonl where it ships one, "
                                "else the built-in arithmetic, units and facts questions; at most 256 probes in 1 MiB")
    reference_text: str | None = Field(None, description="Text whose perplexity is compared with the last good "
                                       "deployment's; empty: a built-in sentence")
    max_tokens: int = Field(16, ge=1, description="Tokens generated per probe")
    reasoning_max_tokens: int = Field(1024, ge=1, description="Tokens the reasoning probe may spend thinking and "
                                      "answering, with a reasoning parser; a thought that does not end within "
                                      "them is reported as the budget, not as a wrong answer")
    chat: bool = Field(True, description="Ask the probes through the chat endpoint too, in the model's chat "
                       "template, where the model ships one")
    min_accuracy: float = Field(0.8, ge=0, le=1, description="Share of probes answered right, at least")
    max_accuracy_drop: float = Field(0.1, ge=0, le=1, description="Accuracy below the last good deployment's by "
                                     "more than this fails")
    max_perplexity_ratio: float = Field(1.5, gt=1, description="Perplexity of the reference text above the last "
                                        "good deployment's by more than this factor fails")
    max_reference_p: float = Field(0.01, gt=0, lt=1, description="Fail when the reference text's tokens, paired "
                                   "with the last good deployment's, got less likely beyond this chance (one-sided "
                                   "sign test) and by more than min_reference_change")
    min_reference_change: float = Field(0.05, ge=0, description="The paired test's effect floor: mean change in "
                                        "nats per reference token (0.05: x1.05 perplexity) below which it passes")
    under_load: bool = Field(True, description="Ask the probes again while long requests fill the KV cache past "
                             "load_target: a server that degenerates when full fails")
    load_target: float = Field(0.9, gt=0, lt=1, description="KV cache usage the probes under load wait for")
    max_flip_p: float = Field(0.05, gt=0, lt=1, description="New weights: fail when probes flip from right to wrong "
                              "more than from wrong to right beyond this chance (exact McNemar); under the same "
                              "weights any such flip fails")
    allow_changed_files: bool = Field(False, description="A changed vocabulary under weights of the same shapes, or "
                                      "a changed config.json under the same weight files, is intended (a retrained "
                                      "tokenizer, a corrected config): named, not failed")
    max_changed_outputs: float = Field(0.1, ge=0, le=1, description="Same commit as the last good deployment: share "
                                       "of greedy outputs that may differ from its")

    def for_model(self, model_dir: Path) -> AnswerSpec:
        """A relative probes path is a probe set shipped with the model: resolved in its folder. With
        none named, the model's own `answer-probes.jsonl` where it ships one: its authors know what it
        should answer, and a model that only counts fails the built-in arithmetic whatever its state.
        A model without a chat template is asked by completion alone."""
        from tasks.answers.files import has_chat_template  # reads JSON; this module stays light for the CLI

        update = {} if has_chat_template(model_dir) else {"chat": False}  # nothing served to ask through
        if self.probes is None:
            shipped = model_dir / SHIPPED_PROBES
            if shipped.is_file():
                update["probes"] = shipped
        elif not self.probes.is_absolute():
            update["probes"] = model_dir / self.probes
        return self.model_copy(update=update)
