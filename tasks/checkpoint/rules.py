"""Does the checkpoint store what its compressed-tensors config says it stores?

A wrong ignore list surfaces only after a 36-minute download and minutes of weight loading, as a
shape error deep inside vLLM. Here the config is checked against the safetensors headers alone
(plus the 2-element weight_shape tensors), in seconds, before any GPU is touched.
"""

from __future__ import annotations

import gc
import re
from bisect import bisect_right
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate, chain
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from tasks.checkpoint.headers import TensorMeta
from tasks.checkpoint.names import PART_TO_FUSED, IgnoreMatcher, PatternBudget, engine_names, match_name
from tasks.checkpoint.quant_config import (
    CompressedTensorsConfig,
    ConfigGroup,
    QuantArgs,
    checked_text_config,
    parse_quant_config,
)
from tasks.checkpoint.view import CheckpointView, local_view, remote_view
from tasks.findings import Violation

if TYPE_CHECKING:  # the hub stack is imported where a repo id is validated, not for a local folder
    from tasks.hub import RepoSnapshot

UNQUANTIZED_DTYPES = {"BF16", "F16", "F32"}
INT_DTYPES = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}
PACKED_PARAMS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
EMBEDDING_NAMES = {"embed_tokens", "wte", "wpe", "word_embeddings", "tok_embeddings", "embed_positions"}
# Towers the quantizer may skip without naming them: the engine builds them without the quant config.
UNSCOPED_PARTS = {"vision_tower", "visual", "vision_model", "mm_projector", "multi_modal_projector", "audio_tower"}


class ValidationReport(BaseModel):
    source: str
    verdict: Literal["pass", "fail"]
    quant_method: str | None
    violations: list[Violation]
    warnings: list[Violation]
    notes: list[str]
    files: int
    tensors: int
    modules_packed: int
    modules_unquantized: int
    total_bytes: int
    bytes_read: int
    kv_cache_scheme: dict | None = None
    summary: list[dict] = Field(default_factory=list, description="module role/storage/dtype -> count, bytes")


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


def group_modules(tensors: dict[str, TensorMeta]) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for name, meta in tensors.items():
        module, _, param = name.rpartition(".")
        if param == "weight" or param in PACKED_PARAMS:
            if (found := modules.get(module)) is None:
                found = modules[module] = Module(module)
            found.params[param] = meta
    return modules


def module_kind(module: Module, expert_parents: set[str]) -> str:
    """Linear, embedding, router or other, from the stored layout (the model code is not at hand).

    A DeepSeek/Kimi router (`mlp.gate`) stores a 2-D weight but is no nn.Linear, so a "Linear"
    target does not reach it; it is recognised by the experts beside it.
    """
    parent, _, leaf = module.name.rpartition(".")
    if leaf in EMBEDDING_NAMES:
        return "embedding"
    if leaf == "gate" and parent in expert_parents:
        return "router"
    if module.packed or ("weight" in module.params and len(module.params["weight"].shape) == 2):
        return "linear"
    return "other"  # a stray weight_scale or weight_shape without its weight is no module to check


def _unscoped(name: str) -> bool:
    return not UNSCOPED_PARTS.isdisjoint(name.split("."))


def module_role(name: str, kind: str) -> str:
    """A coarse role for the summary table: what an engineer reads an ignore list in terms of."""
    if _unscoped(name):
        return "vision/projector"
    if kind in ("embedding", "router"):
        return kind
    if name.endswith("lm_head"):
        return "lm_head"
    for marker, role in ((".shared_experts.", "shared expert"), (".experts.", "routed expert"), ("attn", "attention"),
                         (".mlp.", "dense mlp")):
        if marker in name:
            return role
    return kind


def _check_packed(module: Module, args: QuantArgs, values: dict[TensorMeta, tuple[int, ...]]) -> list[str]:
    """Problems with one packed module's layout, empty when it matches the scheme."""
    p = module.params
    missing = [n for n in ("weight_packed", "weight_scale", "weight_shape") if n not in p]
    if missing:
        return [f"packed without {', '.join(missing)}"]
    packed, scale, shape = p["weight_packed"], p["weight_scale"], p["weight_shape"]
    if shape.dtype not in INT_DTYPES or shape.shape != (2,):
        return [f"weight_shape is {shape.dtype}{list(shape.shape)}, expected an integer tensor of 2 values"]
    if packed.dtype != "I32" or len(packed.shape) != 2:
        return [f"weight_packed is {packed.dtype}{list(packed.shape)}, expected a 2-D I32 tensor"]
    per_int = 32 // args.num_bits
    # Without the stored values (before download) the packed shape stands in for them.
    out_f, in_f = values.get(shape, (packed.shape[0], packed.shape[1] * per_int))
    problems = []
    if list(packed.shape) != [out_f, -(-in_f // per_int)]:
        problems.append(f"weight_packed is I32{list(packed.shape)} but weight_shape [{out_f}, {in_f}] "
                        f"needs I32[{out_f}, {-(-in_f // per_int)}] at {args.num_bits} bits")
    if args.strategy == "group" and args.group_size:
        want = [out_f, -(-in_f // args.group_size)]
    elif args.strategy == "channel":
        want = [out_f, 1]
    else:
        want = None
    if want and list(scale.shape) != want:
        problems.append(f"weight_scale is {list(scale.shape)}, expected {want} for {args.strategy} "
                        f"{args.group_size or ''}".rstrip())
    return problems


def _check_weight_map(view: CheckpointView, tensors: dict[str, TensorMeta], out: list[Violation]) -> None:
    for name in sorted(view.missing_shards):
        out.append(Violation(rule="weight-map-missing-file", module=name,
                             message="model.safetensors.index.json names this shard but it is not stored"))
    if view.weight_map is None:
        return
    named = set(view.weight_map.values())
    for name in sorted(view.stored_shards - named):
        out.append(Violation(rule="shard-not-in-weight-map", module=name,
                             message="stored shard that the weight_map never names (vLLM would ignore it)"))
    stored = view.stored_shards
    where = dict(zip(tensors, map(attrgetter("file"), tensors.values())))  # tensor -> file, built in C
    if where.items() >= view.weight_map.items():  # the usual case, decided in C: every entry holds
        return
    wrong = [t for t, f in view.weight_map.items() if f in stored and where.get(t) != f]
    if wrong:
        out.append(Violation(rule="weight-map-mismatch", module=wrong[0],
                             message=f"{len(wrong)} tensor(s) not stored where the weight_map says, e.g. this one "
                                     f"(map: {view.weight_map[wrong[0]]})"))


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?")


def _check_config_agrees(text_config: dict, modules: dict[str, Module], out: list[Violation]) -> None:
    """Layer and expert counts in config.json must describe the stored tensors."""
    layers: set[int] = set()
    per_layer: dict[int, int] = defaultdict(int)
    for name in modules:
        if (m := _LAYER.search(name)) and not _unscoped(name):
            layer = int(m[1])
            layers.add(layer)
            if m[2] is not None:
                per_layer[layer] = max(per_layer[layer], int(m[2]) + 1)
    declared = text_config.get("num_hidden_layers")
    if isinstance(declared, int) and layers:
        nextn = int(text_config.get("num_nextn_predict_layers") or 0)
        stored = max(layers) + 1
        if stored not in (declared, declared + nextn):
            out.append(Violation(rule="config-layer-count", module="num_hidden_layers",
                                 message=f"config says {declared} layers (+{nextn} MTP) but tensors hold {stored}"))
    experts_declared = next((text_config[k] for k in ("n_routed_experts", "num_experts", "num_local_experts")
                             if isinstance(text_config.get(k), int)), None)
    bad = {layer: count for layer, count in per_layer.items() if count != experts_declared}
    if experts_declared is not None and bad:
        layer = min(bad)
        out.append(Violation(rule="config-expert-count", module=f"layers.{layer}.mlp.experts",
                             message=f"config says {experts_declared} routed experts but layer {layer} stores "
                                     f"{bad[layer]} ({len(bad)} layer(s) disagree)"))


def _summary(modules: dict[str, Module], kinds: dict[str, str]) -> list[dict]:
    counts: Counter[tuple[str, str, str]] = Counter()
    nbytes: Counter[tuple[str, str, str]] = Counter()
    for name, module in modules.items():
        packed, weight = module.params.get("weight_packed"), module.params.get("weight")
        storage, dtype = ("packed", packed.dtype) if packed else ("unquantized", weight.dtype) if weight else (
            "incomplete", next(iter(module.params.values())).dtype)
        key = (module_role(name, kinds[name]), storage, dtype)
        counts[key] += 1
        nbytes[key] += sum([t.end - t.start for t in module.params.values()])
    rows = [{"role": role, "storage": storage, "dtype": dtype, "modules": counts[role, storage, dtype],
             "bytes": nbytes[role, storage, dtype]} for role, storage, dtype in counts]
    return sorted(rows, key=lambda r: -r["bytes"])


def validate(view: CheckpointView) -> ValidationReport:
    """Every rule over one checkpoint; violations fail it, warnings and notes inform."""
    tensors: dict[str, TensorMeta] = {}
    for h in view.headers:
        tensors.update(h.tensors)
    modules = group_modules(tensors)
    expert_parents = {n.split(".experts.")[0] for n in modules if ".experts." in n}
    kinds = {name: module_kind(m, expert_parents) for name, m in modules.items()}
    violations: list[Violation] = []
    warnings: list[Violation] = []
    notes: list[str] = []
    bytes_read = view.bytes_read

    _check_weight_map(view, tensors, violations)
    text_config = checked_text_config(view.config, view.source)
    _check_config_agrees(text_config, modules, violations)
    raw = view.config.get("quantization_config") or text_config.get("quantization_config")
    quant_method = raw.get("quant_method") if isinstance(raw, dict) else None
    if not raw:
        notes.append("no quantization_config: the checkpoint is served as stored; nothing to check against")
    elif quant_method != "compressed-tensors":
        notes.append(f"quant_method {quant_method!r}: only compressed-tensors layouts are checked")
    else:
        qc = parse_quant_config(raw, view.source)
        shape_metas = [m.params["weight_shape"] for m in modules.values() if "weight_shape" in m.params]
        if view.read_values is None:
            values = {}
            notes.append("weight_shape values not read (remote view): packed shapes checked against each other")
        else:
            values = view.read_values(shape_metas)
            bytes_read += sum(m.nbytes for m in values)
        _check_compressed_tensors(qc, modules, kinds, values=values, violations=violations, warnings=warnings,
                                  notes=notes)

    return ValidationReport(
        source=view.source,
        verdict="fail" if violations else "pass",
        quant_method=quant_method,
        violations=violations,
        warnings=warnings,
        notes=notes,
        files=len(view.headers),
        tensors=len(tensors),
        modules_packed=sum(m.packed for m in modules.values()),
        modules_unquantized=sum(m.unquantized and not m.packed for m in modules.values()),
        total_bytes=view.total_bytes,
        bytes_read=bytes_read,
        kv_cache_scheme=raw.get("kv_cache_scheme") if isinstance(raw, dict) else None,
        summary=_summary(modules, kinds),
    )


def _scheme_for(qc: CompressedTensorsConfig, name: str, kind: str, budget: PatternBudget) -> ConfigGroup | None:
    """The first config group targeting the module, by class ("Linear") or by name."""
    for group in qc.config_groups.values():
        if kind == "linear" and "Linear" in group.targets:
            return group
        if any(match_name(name, t, budget) for t in group.targets if t != "Linear"):
            return group
    return None


def _check_compressed_tensors(
    qc: CompressedTensorsConfig,
    modules: dict[str, Module],
    kinds: dict[str, str],
    *,
    values: dict[TensorMeta, tuple[int, ...]],
    violations: list[Violation],
    warnings: list[Violation],
    notes: list[str],
) -> None:
    used_ignores: set[str] = set()
    unscoped: list[str] = []
    fused_ignored: dict[str, dict[str, bool]] = defaultdict(dict)

    checked = [(name, m) for name, m in modules.items() if kinds[name] not in ("embedding", "other")]
    per_module = [engine_names(name) for name, _ in checked]
    first = list(accumulate(map(len, per_module), initial=0))  # index in `flat` of each module's first name
    flat = list(chain.from_iterable(per_module))
    module_hits: dict[int, set[str]] = defaultdict(set)
    budget = PatternBudget()  # every pattern of this validation, ignore and targets, within one time bound
    for j, entries in IgnoreMatcher(qc.ignore, budget).hits(flat).items():
        module_hits[bisect_right(first, j) - 1] |= entries
    for j in module_hits.values():
        used_ignores |= j
    # Experts repeat one layout tens of thousands of times: each distinct layout is checked once.
    layout_problems: dict[tuple, list[str]] = {}
    for k, (name, module) in enumerate(checked):
        hits = module_hits.get(k)
        leaf = name.rpartition(".")[2]
        if leaf in PART_TO_FUSED:
            fused_ignored[f"{name.rpartition('.')[0]}.{PART_TO_FUSED[leaf]}"][leaf] = bool(hits)
        params = module.params
        packed = params.get("weight_packed")
        if packed and "weight" in params:
            violations.append(Violation(rule="half-quantized", module=name, message="stores both weight and weight_packed"))
            continue
        if hits:
            if packed:
                violations.append(Violation(
                    rule="ignored-module-packed", module=name,
                    message=f"ignored by {sorted(hits)[0]!r} but stored as weight_packed"))
            elif params["weight"].dtype not in UNQUANTIZED_DTYPES:
                violations.append(Violation(
                    rule="ignored-module-dtype", module=name,
                    message=f"ignored but stored as {params['weight'].dtype}, not bf16/fp16/fp32"))
            continue
        group = _scheme_for(qc, name, kinds[name], budget)
        if group is None:
            continue
        if packed:
            if group.weights is not None:
                # What _check_packed reads, without offsets: one key per distinct expert layout.
                scale, shape = params.get("weight_scale"), params.get("weight_shape")
                layout = (id(group.weights), packed[:2], scale and scale[:2], shape and shape[:2],
                          shape and values.get(shape))
                if (problems := layout_problems.get(layout)) is None:
                    problems = layout_problems[layout] = _check_packed(module, group.weights, values)
                for problem in problems:
                    violations.append(Violation(rule="packed-layout", module=name, message=problem))
        elif _unscoped(name):
            unscoped.append(name)
        else:
            violations.append(Violation(
                rule="targeted-module-unpacked", module=name,
                message=f"targeted by {group.targets} and not ignored, but stored unquantized as weight"))

    for fused, parts in sorted(fused_ignored.items()):
        if len(set(parts.values())) > 1:
            violations.append(Violation(
                rule="fused-parts-disagree", module=fused,
                message=f"vLLM loads {fused} as one module but the ignore list covers only "
                        f"{sorted(k for k, v in parts.items() if v)}"))
    for entry in qc.ignore:
        if entry not in used_ignores:
            warnings.append(Violation(rule="stale-ignore", module=entry, message="ignore entry matches no stored module"))
    if unscoped:
        notes.append(
            f"{len(unscoped)} vision/projector modules stored unquantized without an ignore entry "
            f"(e.g. {unscoped[0]}); the engine builds those towers without the quantization config"
        )
    notes.append(f"kv_cache_scheme: {qc.kv_cache_scheme}")


@contextmanager
def _gc_paused():
    """A Kimi-sized header is ~10^6 acyclic objects; the cycle collector re-walking them as they are
    built costs more than the parse itself. Pause it for the read and the rules."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def validate_checkpoint(model_dir: Path) -> ValidationReport:
    with _gc_paused():
        return validate(local_view(model_dir))


def validate_snapshot(snapshot: RepoSnapshot, endpoint: str | None = None) -> ValidationReport:
    """The hub's copy of a resolved snapshot, from its headers (range requests), before any download."""
    with _gc_paused():
        return validate(remote_view(snapshot, endpoint))


def validate_remote(repo_id: str, revision: str = "main", endpoint: str | None = None) -> ValidationReport:
    from tasks.hub import resolve_snapshot

    return validate_snapshot(resolve_snapshot(repo_id, revision, endpoint), endpoint)
