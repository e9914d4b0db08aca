"""Does the checkpoint store what its compressed-tensors config says it stores?

A wrong ignore list surfaces only after a 36-minute download and minutes of weight loading, as a
shape error deep inside vLLM. Here the config is checked against the safetensors headers alone
(plus the 2-element weight_shape tensors), in seconds, before any GPU is touched.
"""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prefect import task
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import safe_open

UNQUANTIZED_DTYPES = {"BF16", "F16", "F32"}
INT_DTYPES = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}
PACKED_PARAMS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
EMBEDDING_NAMES = {"embed_tokens", "wte", "wpe", "word_embeddings", "tok_embeddings", "embed_positions"}
# Towers the quantizer may skip without naming them: the engine builds them without the quant config.
UNSCOPED_PARTS = {"vision_tower", "visual", "vision_model", "mm_projector", "multi_modal_projector", "audio_tower"}
# vLLM's fused modules and their stored parts; an ignore entry may name either.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
_PART_TO_FUSED = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}


class CheckpointError(ValueError):
    """The checkpoint cannot be read at all (missing dir, bad JSON, unreadable header)."""


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


class Violation(BaseModel):
    rule: str
    module: str
    message: str


class ValidationReport(BaseModel):
    model_dir: str
    verdict: Literal["pass", "fail"]
    quant_method: str | None
    violations: list[Violation]
    warnings: list[Violation]
    notes: list[str]
    files: int
    tensors: int
    modules_packed: int
    modules_unquantized: int
    header_bytes_read: int


@dataclass
class TensorMeta:
    dtype: str
    shape: list[int]
    file: Path


@dataclass
class Module:
    name: str
    params: dict[str, TensorMeta] = field(default_factory=dict)

    @property
    def packed(self) -> bool:
        return "weight_packed" in self.params

    @property
    def unquantized(self) -> bool:
        return "weight" in self.params


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' rule: `re:` entries by re.match (anchored at the start), others exactly."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target == name


def engine_names(name: str) -> list[str]:
    """The names an ignore entry may be written against: as stored, as vLLM names it, fused."""
    names = [name]
    if name.startswith("language_model."):  # vLLM drops the wrapper for lm_head and friends
        names.append(name.removeprefix("language_model."))
    parent, _, leaf = name.rpartition(".")
    if leaf in _PART_TO_FUSED:
        names += [f"{n.rpartition('.')[0]}.{_PART_TO_FUSED[leaf]}" for n in list(names)]
    return names


def load_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def parse_quant_config(raw: dict, source: Path) -> CompressedTensorsConfig:
    try:
        return CompressedTensorsConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise CheckpointError(f"{source}: quantization_config.{where}: {err['msg']}") from exc


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: no readable weight_map ({exc})") from exc
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"{model_dir}: weight_map names missing shard(s) {', '.join(missing[:3])}")
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    return files


def read_headers(files: list[Path]) -> tuple[dict[str, TensorMeta], int]:
    """Tensor names, dtypes and shapes from the headers; returns them and the header bytes read."""
    tensors: dict[str, TensorMeta] = {}
    header_bytes = 0
    for path in files:
        try:
            with path.open("rb") as fh:
                header_bytes += 8 + struct.unpack("<Q", fh.read(8))[0]
            with safe_open(path, framework="numpy") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    tensors[name] = TensorMeta(dtype=s.get_dtype(), shape=list(s.get_shape()), file=path)
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from exc
    return tensors, header_bytes


def group_modules(tensors: dict[str, TensorMeta]) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for name, meta in tensors.items():
        module, _, param = name.rpartition(".")
        if param == "weight" or param in PACKED_PARAMS:
            modules.setdefault(module, Module(module)).params[param] = meta
    return modules


def module_kind(module: Module, names: set[str]) -> str:
    """Linear, embedding, router or other, from the stored layout (the model code is not at hand).

    A DeepSeek/Kimi router (`mlp.gate`) stores a 2-D weight but is no nn.Linear, so a "Linear"
    target does not reach it; it is recognised by the experts beside it.
    """
    parent, _, leaf = module.name.rpartition(".")
    if leaf in EMBEDDING_NAMES:
        return "embedding"
    if leaf == "gate" and any(n.startswith(f"{parent}.experts.") for n in names):
        return "router"
    if module.packed or len(module.params["weight"].shape) == 2:
        return "linear"
    return "other"


def _read_shape_values(meta: TensorMeta, name: str) -> list[int]:
    with safe_open(meta.file, framework="numpy") as f:
        return [int(v) for v in f.get_tensor(name).reshape(-1)]


def _check_packed(module: Module, args: QuantArgs) -> list[str]:
    """Problems with one packed module's layout, empty when it matches the scheme."""
    p = module.params
    missing = [n for n in ("weight_packed", "weight_scale", "weight_shape") if n not in p]
    if missing:
        return [f"packed without {', '.join(missing)}"]
    problems = []
    packed, scale, shape = p["weight_packed"], p["weight_scale"], p["weight_shape"]
    if shape.dtype not in INT_DTYPES or shape.shape != [2]:
        return [f"weight_shape is {shape.dtype}{shape.shape}, expected an integer tensor of 2 values"]
    out_f, in_f = _read_shape_values(shape, f"{module.name}.weight_shape")
    per_int = 32 // args.num_bits
    if packed.dtype != "I32" or packed.shape != [out_f, -(-in_f // per_int)]:
        problems.append(f"weight_packed is {packed.dtype}{packed.shape}, expected I32[{out_f}, {-(-in_f // per_int)}]")
    if args.strategy == "group" and args.group_size:
        want = [out_f, -(-in_f // args.group_size)]
    elif args.strategy == "channel":
        want = [out_f, 1]
    else:
        want = None
    if want and scale.shape != want:
        problems.append(f"weight_scale is {scale.shape}, expected {want} for {args.strategy} {args.group_size or ''}")
    return problems


def validate_checkpoint(model_dir: Path) -> ValidationReport:
    config = load_config(model_dir)
    files = shard_files(model_dir)
    tensors, header_bytes = read_headers(files)
    modules = group_modules(tensors)
    names = set(modules)
    violations: list[Violation] = []
    warnings: list[Violation] = []
    notes: list[str] = []

    raw = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    quant_method = raw.get("quant_method") if raw else None
    if not raw:
        notes.append("no quantization_config: the checkpoint is served as stored; nothing to check against")
    elif quant_method != "compressed-tensors":
        notes.append(f"quant_method {quant_method!r}: only compressed-tensors layouts are checked")
    else:
        qc = parse_quant_config(raw, model_dir / "config.json")
        _check_compressed_tensors(qc, modules, names, violations, warnings, notes)

    return ValidationReport(
        model_dir=str(model_dir),
        verdict="fail" if violations else "pass",
        quant_method=quant_method,
        violations=violations,
        warnings=warnings,
        notes=notes,
        files=len(files),
        tensors=len(tensors),
        modules_packed=sum(m.packed for m in modules.values()),
        modules_unquantized=sum(m.unquantized and not m.packed for m in modules.values()),
        header_bytes_read=header_bytes,
    )


def _check_compressed_tensors(
    qc: CompressedTensorsConfig,
    modules: dict[str, Module],
    names: set[str],
    violations: list[Violation],
    warnings: list[Violation],
    notes: list[str],
) -> None:
    used_ignores: set[str] = set()
    unscoped: list[str] = []
    fused_ignored: dict[str, dict[str, bool]] = defaultdict(dict)

    for name, module in sorted(modules.items()):
        kind = module_kind(module, names)
        if kind in ("embedding", "other"):
            continue
        candidates = engine_names(name)
        hits = {ign for ign in qc.ignore for n in candidates if match_name(n, ign)}
        used_ignores |= hits
        ignored = bool(hits)
        leaf = name.rpartition(".")[2]
        if leaf in _PART_TO_FUSED:
            fused_ignored[f"{name.rpartition('.')[0]}.{_PART_TO_FUSED[leaf]}"][leaf] = ignored
        group = next(
            (
                g
                for g in qc.config_groups.values()
                if any((t == "Linear" and kind == "linear") or match_name(name, t) for t in g.targets)
            ),
            None,
        )

        if module.packed and module.unquantized:
            violations.append(Violation(rule="half-quantized", module=name, message="stores both weight and weight_packed"))
            continue
        if ignored:
            if module.packed:
                violations.append(Violation(
                    rule="ignored-module-packed", module=name,
                    message=f"ignored by {sorted(hits)[0]!r} but stored as weight_packed"))
            elif module.params["weight"].dtype not in UNQUANTIZED_DTYPES:
                violations.append(Violation(
                    rule="ignored-module-dtype", module=name,
                    message=f"ignored but stored as {module.params['weight'].dtype}, not bf16/fp16/fp32"))
            continue
        if group is None:
            continue
        if module.packed:
            if group.weights is not None:
                for problem in _check_packed(module, group.weights):
                    violations.append(Violation(rule="packed-layout", module=name, message=problem))
        elif set(name.split(".")) & UNSCOPED_PARTS:
            unscoped.append(name)
        else:
            violations.append(Violation(
                rule="targeted-module-unpacked", module=name,
                message=f"targeted by {group.targets} and not ignored, but stored unquantized as weight"))

    for fused, parts in sorted(fused_ignored.items()):
        if len(set(parts.values())) > 1:
            violations.append(Violation(
                rule="fused-parts-disagree", module=fused,
                message=f"vLLM loads {fused} as one module but the ignore list covers only {sorted(k for k, v in parts.items() if v)}"))
    for entry in qc.ignore:
        if entry not in used_ignores:
            warnings.append(Violation(rule="stale-ignore", module=entry, message="ignore entry matches no stored module"))
    if unscoped:
        notes.append(
            f"{len(unscoped)} vision/projector modules stored unquantized without an ignore entry "
            f"(e.g. {unscoped[0]}); the engine builds those towers without the quantization config"
        )
    notes.append(f"kv_cache_scheme: {qc.kv_cache_scheme}")


@task(name="validate-checkpoint", tags=["validate"])
def validate_checkpoint_task(model_dir: Path) -> ValidationReport:
    return validate_checkpoint(model_dir)
