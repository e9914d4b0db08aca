"""A candidate space over VllmSettings, expanded into launches ordered likeliest winner first.

The search this replaces was done by hand, one 5-25 minute load per try: TP=8 with and without
expert parallelism, DP layouts, batch limits, the all2all backend, EPLB, the KV cache dtype.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

from pydantic import BaseModel, Field

from tasks.answers.spec import AnswerSpec
from tasks.vllm.settings import VllmSettings


class Layout(BaseModel):
    """TP x DP GPUs, expert parallelism on or off."""

    tensor_parallel_size: int = Field(..., ge=1)
    data_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = True

    @property
    def label(self) -> str:
        dp = f" x DP={self.data_parallel_size}" if self.data_parallel_size > 1 else ""
        return f"TP={self.tensor_parallel_size}{dp}{' + EP' if self.enable_expert_parallel else ''}"


def _kimi_layouts() -> list[Layout]:
    # Likeliest first on 8 PCIe GPUs: TP=8 + EP (the hand-tuned Kimi-K2.5 deployment), then layouts
    # with less allreduce over PCIe, then plain TP=8 (a slower INT4 MoE path: modelplane #194).
    return [Layout(tensor_parallel_size=8), Layout(tensor_parallel_size=4, data_parallel_size=2),
            Layout(tensor_parallel_size=2, data_parallel_size=4), Layout(tensor_parallel_size=1, data_parallel_size=8),
            Layout(tensor_parallel_size=8, enable_expert_parallel=False)]


class TuneSpace(BaseModel):
    """Every list is one axis; the candidates are their product, each applied over the base settings.
    The default is an 8-GPU box serving a Kimi-K2.5-sized MoE."""

    layouts: list[Layout] = Field(default_factory=_kimi_layouts, description="TP x DP, EP on or off")
    max_num_seqs: list[int | None] = Field([256, 128], description="--max-num-seqs values; null: vLLM's default")
    max_num_batched_tokens: list[int | None] = Field([None], description="--max-num-batched-tokens values")
    all2all_backend: list[str | None] = Field([None], description="--all2all-backend values (EP only); null: "
                                                                   "vLLM's default")
    enable_eplb: list[bool] = Field([False], description="--enable-eplb (EP only)")
    kv_cache_dtype: list[str] = Field(["auto"], description="--kv-cache-dtype values")
    flags: dict[str, list[str]] = Field(default_factory=dict, description="Any further vLLM flag with its values "
                                                                          "('' for a bare flag), e.g. "
                                                                          "{'--block-size': ['16', '64']}")
    extra: list[dict[str, Any]] = Field(default_factory=list, description="Further candidates as they are, not "
                                                                          "multiplied: VllmSettings fields over the "
                                                                          "base, e.g. {'max_model_len': 262144}")


class Candidate(BaseModel):
    """One launch: its settings, and how they differ from the base, in flags."""

    name: str
    settings: VllmSettings


LAYOUT_FIELDS = set(Layout.model_fields)


def _name(layout: Layout, base: VllmSettings, settings: VllmSettings) -> str:
    """The layout, then every other setting that differs from the base, as flags would say it."""
    changed = [f"{k}={v}" for k, v in settings.model_dump(exclude={"extra_args"} | LAYOUT_FIELDS).items()
               if v != getattr(base, k)]
    added = settings.extra_args[len(base.extra_args):]
    return ", ".join([layout.label, *changed] + ([" ".join(added)] if added else []))


def candidates(base: VllmSettings, space: TuneSpace) -> list[Candidate]:
    """The product of the axes over `base`, in order: layouts as listed (likeliest first), then the
    other axes' values as listed, then the extra candidates. EP-only options are not varied where EP
    is off."""
    found: list[Candidate] = []
    extra_axes = [[(flag, v) for v in values] for flag, values in space.flags.items()]
    for layout in space.layouts:
        ep = layout.enable_expert_parallel
        for seqs, tokens, a2a, eplb, kv, *extras in itertools.product(
                space.max_num_seqs, space.max_num_batched_tokens, space.all2all_backend if ep else [None],
                space.enable_eplb if ep else [False], space.kv_cache_dtype, *extra_axes):
            args = list(base.extra_args)
            args += ["--all2all-backend", a2a] if a2a else []
            args += ["--enable-eplb"] if eplb else []
            for flag, value in extras:
                args += [flag, value] if value else [flag]
            settings = base.model_copy(update={**layout.model_dump(), "max_num_seqs": seqs,
                                               "max_num_batched_tokens": tokens, "kv_cache_dtype": kv,
                                               "extra_args": args})
            if all(c.settings != settings for c in found):
                found.append(Candidate(name=_name(layout, base, settings), settings=settings))
    for overrides in space.extra:
        settings = VllmSettings.model_validate({**base.model_dump(), **overrides})
        if all(c.settings != settings for c in found):
            layout = Layout.model_validate({k: getattr(settings, k) for k in LAYOUT_FIELDS})
            found.append(Candidate(name=_name(layout, base, settings), settings=settings))
    return found


def candidate_key(candidate: Candidate, commit: str, *, vllm_version: str, gpus: str, bench: BaseModel,
                  answers: AnswerSpec) -> str:
    """What makes a measurement reusable: the same model commit, vLLM, GPUs (the host's, by its
    models root), load, settings and answer check (its thresholds and its probes' contents: a
    candidate that failed probes since fixed must be measured again, not read back failed)."""
    probes = answers.probes
    probes_digest = hashlib.sha256(probes.read_bytes()).hexdigest() if probes and probes.is_file() else None
    what = json.dumps([candidate.settings.model_dump(mode="json"), commit, vllm_version, gpus,
                       bench.model_dump(mode="json"), answers.model_dump(mode="json"), probes_digest], sort_keys=True)
    return "tune-" + hashlib.sha256(what.encode()).hexdigest()[:32]
