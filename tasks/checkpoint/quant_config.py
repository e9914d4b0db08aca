"""A checkpoint's compressed-tensors `quantization_config`, as typed models; extra keys are kept."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.errors import CheckpointError


class QuantArgs(BaseModel):
    model_config = ConfigDict(extra="allow")
    num_bits: int
    type: Literal["int", "float"]
    symmetric: bool = True
    strategy: str
    group_size: int | None = None


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
