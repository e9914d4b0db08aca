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
                                "else the built-in arithmetic, units and facts questions")
    reference_text: str | None = Field(None, description="Text whose perplexity is compared with the last good "
                                       "deployment's; empty: a built-in sentence")
    max_tokens: int = Field(16, ge=1, description="Tokens generated per probe")
    min_accuracy: float = Field(0.8, ge=0, le=1, description="Share of probes answered right, at least")
    max_accuracy_drop: float = Field(0.1, ge=0, le=1, description="Accuracy below the last good deployment's by "
                                     "more than this fails")
    max_perplexity_ratio: float = Field(1.5, gt=1, description="Perplexity of the reference text above the last "
                                        "good deployment's by more than this factor fails")
    max_changed_outputs: float = Field(0.1, ge=0, le=1, description="Same commit as the last good deployment: share "
                                       "of greedy outputs that may differ from its")

    def for_model(self, model_dir: Path) -> AnswerSpec:
        """A relative probes path is a probe set shipped with the model: resolved in its folder. With
        none named, the model's own `answer-probes.jsonl` where it ships one: its authors know what it
        should answer, and a model that only counts fails the built-in arithmetic whatever its state."""
        if self.probes is None:
            shipped = model_dir / SHIPPED_PROBES
            return self.model_copy(update={"probes": shipped}) if shipped.is_file() else self
        if self.probes.is_absolute():
            return self
        return self.model_copy(update={"probes": model_dir / self.probes})
