"""Model families as data: what each needs from vLLM beyond the weights.

A profile is matched from the checkpoint's own config.json (its `model_type`, else its
architecture), never from the repo's name: a fine-tune under another name is the same family, and a
repo named "kimi" that is not Kimi gets nothing it did not ask for. A profile only fills what the
operator left unset; a flag given on the command line or the form always wins.

Sources, per entry: vLLM's Kimi-K2.5 recipe (docs.vllm.ai/projects/recipes, moonshotai/Kimi-K2.5:
`--mm-encoder-tp-mode data --tool-call-parser kimi_k2 --reasoning-parser kimi_k2
--enable-auto-tool-choice --trust-remote-code`), the model card (instant mode is
`chat_template_kwargs={"thinking": false}`), and vLLM 0.32's own parser registry (`kimi_k2` for
reasoning and tool calls). Remote code is not a profile's to grant: `remote_code.py` decides it
from the repo's files and the operator's consent.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from tasks.answers.check import ChatModes
from tasks.vllm.settings import VllmSettings


class ModelProfile(BaseModel):
    """What one family needs from vLLM and from the answer check."""

    name: str
    model_types: list[str] = Field(default_factory=list)  # config.json "model_type", checked first
    architectures: list[str] = Field(default_factory=list)  # config.json "architectures", where the type is generic
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # vLLM registers this family's config class itself: an auto_map in config.json is not run.
    native_config: bool = False
    # Multimodal settings: flags of a vision encoder (the recipe's data-parallel encoder under TP).
    multimodal_args: list[str] = Field(default_factory=list)
    # The chat template's switch (chat_template_kwargs): probes are asked `instant`, for the answer
    # with no thinking first; the reasoning probe `thinking`, in AnswerSpec.reasoning_max_tokens.
    instant: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Layouts a tune run tries first on an 8-GPU box (TuneSpace candidates' engine settings).
    tune_layouts: list[dict[str, Any]] = Field(default_factory=list)

    def matches(self, config: dict) -> bool:
        model_type = config.get("model_type")
        if self.model_types and model_type in self.model_types:
            return True
        archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
        return bool(self.architectures) and not (self.model_types and model_type) and any(
            a in self.architectures for a in archs)

    def settings_for(self, settings: VllmSettings) -> tuple[VllmSettings, list[str]]:
        """The operator's settings with what this family needs filled in where they left it unset,
        and the flags added, for the one line the deploy logs."""
        update: dict[str, Any] = {}
        added: list[str] = []
        if self.tool_call_parser and settings.tool_call_parser is None:
            update["tool_call_parser"] = self.tool_call_parser
            added.append(f"--tool-call-parser {self.tool_call_parser}")
            if self.enable_auto_tool_choice and not settings.enable_auto_tool_choice:
                update["enable_auto_tool_choice"] = True
                added.append("--enable-auto-tool-choice")
        if self.reasoning_parser and settings.reasoning_parser is None:
            update["reasoning_parser"] = self.reasoning_parser
            added.append(f"--reasoning-parser {self.reasoning_parser}")
        given = {a.split("=")[0] for a in settings.extra_args if a.startswith("--")}
        if self.multimodal_args and self.multimodal_args[0].split("=")[0] not in given:
            update["extra_args"] = [*settings.extra_args, *self.multimodal_args]
            added.append(" ".join(self.multimodal_args))
        return settings.model_copy(update=update), added


KIMI_LAYOUTS = [
    {"tensor_parallel_size": 8, "enable_expert_parallel": True},
    {"tensor_parallel_size": 4, "data_parallel_size": 2, "enable_expert_parallel": True},
    {"tensor_parallel_size": 8, "enable_expert_parallel": False},
]

PROFILES: tuple[ModelProfile, ...] = (
    ModelProfile(name="Kimi-K2.5", model_types=["kimi_k25"], architectures=["KimiK25ForConditionalGeneration"],
                 native_config=True, tool_call_parser="kimi_k2", reasoning_parser="kimi_k2", enable_auto_tool_choice=True,
                 multimodal_args=["--mm-encoder-tp-mode", "data"],
                 instant={"thinking": False}, thinking={"thinking": True}, tune_layouts=KIMI_LAYOUTS),
    # Kimi-K2-Thinking: the text model alone (DeepseekV3ForCausalLM), Kimi's tokenizer, template and parsers.
    ModelProfile(name="Kimi-K2", model_types=["kimi_k2"], native_config=True, tool_call_parser="kimi_k2", reasoning_parser="kimi_k2",
                 enable_auto_tool_choice=True, instant={"thinking": False}, thinking={"thinking": True},
                 tune_layouts=KIMI_LAYOUTS),
    # DeepSeek-V3 (and the demo model): vLLM and transformers know its config natively (its repo's
    # auto_map is then never run), no reasoning, and tool calls only where the operator asks for them.
    ModelProfile(name="DeepSeek-V3", model_types=["deepseek_v3"], architectures=["DeepseekV3ForCausalLM"],
                 native_config=True, tune_layouts=KIMI_LAYOUTS),
)


def profile_for(config: dict) -> ModelProfile | None:
    """The family a checkpoint's config.json belongs to, or None for one this product has no entry for."""
    return next((p for p in PROFILES if p.matches(config)), None)


def model_config(model_dir) -> dict:
    """config.json as a dict; {} where it cannot be read (validation has named what is wrong)."""
    import json
    from pathlib import Path

    try:
        value = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def family_settings(settings: VllmSettings, model_dir) -> tuple[VllmSettings, ModelProfile | None, list[str]]:
    """The settings a launch of the checkpoint in `model_dir` gets from its family, the family, and
    the flags it added (for the one line the deploy logs)."""
    profile = profile_for(model_config(model_dir))
    if profile is None:
        return settings, None, []
    filled, added = profile.settings_for(settings)
    return filled, profile, added


def family_line(settings: VllmSettings, model_dir) -> str | None:
    """What the deploy logs: the family found and the flags it added, or None where it added none."""
    _, profile, added = family_settings(settings, model_dir)
    if profile is None or not added:
        return None
    return f"{profile.name} family: served with {' '.join(added)} (its profile; a flag given on the form wins)"


def chat_modes(model_dir) -> ChatModes:
    """How the answer check asks this checkpoint's chat template for no thinking, and for thinking."""
    profile = profile_for(model_config(model_dir))
    return ChatModes(instant=profile.instant, thinking=profile.thinking) if profile else ChatModes()
