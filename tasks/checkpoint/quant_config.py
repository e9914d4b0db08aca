"""A checkpoint's config.json as far as validation uses it: the numbers it reads range-checked, and
the compressed-tensors `quantization_config` as typed models (extra keys are kept).

Every value here comes from the model repo: a bit width of 0 divided by zero, a layer count of
1.2e29 passed unseen, and a list where an object belongs crashed. Each is one line naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.errors import CheckpointError
from tasks.trust import shown

# The counts validation compares with the stored tensors, and the range a real model stays within.
COUNTS = {"num_hidden_layers": (1, 4096), "num_nextn_predict_layers": (0, 64), "n_routed_experts": (1, 1 << 16),
          "num_experts": (1, 1 << 16), "num_local_experts": (1, 1 << 16)}


def checked_text_config(config: dict, source: str) -> dict:
    """The text model's config (nested under text_config in multimodal checkpoints), its counts
    whole numbers in range and its quantization_config an object, or one line naming the field."""
    nested = config.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise CheckpointError(f"{source}: config.json: text_config is {type(nested).__name__}, not an object")
    text = nested or config
    prefix = "text_config." if nested else ""
    for key, (low, high) in COUNTS.items():
        value = text.get(key)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise CheckpointError(f"{source}: config.json: {prefix}{key} {shown(value)} is not a whole number "
                                  f"from {low} to {high}")
    for where, holder in (("", config), (prefix, text)):
        quant = holder.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise CheckpointError(f"{source}: config.json: {where}quantization_config is {type(quant).__name__}, "
                                  "not an object")
    return text


class QuantArgs(BaseModel):
    model_config = ConfigDict(extra="allow")
    num_bits: int = Field(ge=1, le=32)  # packed 32 // num_bits to an int32: 0 or 64 would divide by zero
    type: Literal["int", "float"]
    symmetric: bool = True
    strategy: str
    group_size: int | None = Field(None, ge=1, le=1 << 31)


class ConfigGroup(BaseModel):
    model_config = ConfigDict(extra="allow")
    targets: list[str]
    weights: QuantArgs | None = None
    input_activations: QuantArgs | None = None
    format: str | None = None


class CompressedTensorsConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    quant_method: Literal["compressed-tensors"]
    format: str
    config_groups: dict[str, ConfigGroup]
    ignore: list[str] = Field(default_factory=list)
    kv_cache_scheme: dict | None = None
    quantization_status: str | None = None


def parse_quant_config(raw: dict, source: str) -> CompressedTensorsConfig:
    try:
        return CompressedTensorsConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise CheckpointError(f"{source}: config.json: quantization_config.{where}: {err['msg']}") from exc
