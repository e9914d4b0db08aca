"""Checkpoint validation against headers shaped like Kimi-K2.5's, and against the demo's real INT4 file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from flows.cli import app
from flows.demo import BF16_REPO, INT4_REPO
from flows.demo.checkpoint import quantization_config
from tasks.headers import CheckpointError
from tasks.validate import engine_names, match_name, validate_checkpoint

HIDDEN, INTER, EXPERTS = 64, 32, 4
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*layers\.0\.mlp\..*"]


def packed(module: str, out_f: int, in_f: int, shape_dtype=torch.int32, group=32) -> dict:
    return {
        f"{module}.weight_packed": torch.zeros(out_f, in_f // 8, dtype=torch.int32),
        f"{module}.weight_scale": torch.ones(out_f, in_f // group, dtype=torch.bfloat16),
        f"{module}.weight_shape": torch.tensor([out_f, in_f], dtype=shape_dtype),
    }


def plain(module: str, out_f: int, in_f: int, dtype=torch.bfloat16) -> dict:
    return {f"{module}.weight": torch.zeros(out_f, in_f, dtype=dtype)}


def kimi_like_tensors() -> dict[str, torch.Tensor]:
    """Kimi-K2.5's layout in miniature: nested text model, MLA, dense layer 0, experts in INT4, vision tower."""
    t: dict[str, torch.Tensor] = {}
    lm = "language_model"
    t |= plain(f"{lm}.lm_head", 128, HIDDEN)
    t |= plain(f"{lm}.model.embed_tokens", 128, HIDDEN)
    for layer in (0, 1):
        base = f"{lm}.model.layers.{layer}"
        t |= plain(f"{base}.self_attn.q_a_proj", 32, HIDDEN)
        t |= plain(f"{base}.self_attn.kv_a_proj_with_mqa", 32, HIDDEN)
        t |= plain(f"{base}.self_attn.o_proj", HIDDEN, HIDDEN)
        t[f"{base}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    for proj, (o, i) in {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}.items():
        t |= plain(f"{lm}.model.layers.0.mlp.{proj}", o, i)
        t |= plain(f"{lm}.model.layers.1.mlp.shared_experts.{proj}", o, i)
        for e in range(EXPERTS):
            t |= packed(f"{lm}.model.layers.1.mlp.experts.{e}.{proj}", o, i)
    t |= plain(f"{lm}.model.layers.1.mlp.gate", EXPERTS, HIDDEN)  # router: 2-D weight, no nn.Linear
    t[f"{lm}.model.layers.1.mlp.gate.e_score_correction_bias"] = torch.zeros(EXPERTS)
    t |= plain("vision_tower.encoder.blocks.0.attn.qkv", 96, 32)
    t |= plain("mm_projector.proj.0", HIDDEN, 32)
    return t


def write(dir_: Path, tensors: dict, ignore=KIMI_IGNORE, quant: dict | None | str = "default") -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dir_ / "model.safetensors")
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"vocab_size": 128}}
    if quant == "default":
        config["quantization_config"] = quantization_config(ignore)
    elif quant is not None:
        config["quantization_config"] = quant
    (dir_ / "config.json").write_text(json.dumps(config))
    return dir_


def rules(report) -> set[str]:
    return {v.rule for v in report.violations}


def test_kimi_layout_passes_and_notes_the_unnamed_vision_tower(tmp_path):
    report = validate_checkpoint(write(tmp_path / "m", kimi_like_tensors()))
    assert report.verdict == "pass", report.violations
    assert report.modules_packed == 3 * EXPERTS
    assert any("2 vision/projector modules" in n for n in report.notes)
    assert report.warnings == []  # "lm_head" reaches language_model.lm_head as vLLM names it
    assert 0 < report.bytes_read < (tmp_path / "m" / "model.safetensors").stat().st_size


def _attention_packed(t):
    name = "language_model.model.layers.1.self_attn.o_proj"
    del t[f"{name}.weight"]
    t |= packed(name, HIDDEN, HIDDEN)


def _expert_unpacked(t):
    name = "language_model.model.layers.1.mlp.experts.2.up_proj"
    for k in [k for k in t if k.startswith(f"{name}.")]:
        del t[k]
    t |= plain(name, INTER, HIDDEN)


def _shape_values_wrong(t):
    t["language_model.model.layers.1.mlp.experts.0.down_proj.weight_shape"] = torch.tensor([HIDDEN, 64], dtype=torch.int32)


def _half_quantized(t):
    t |= plain("language_model.model.layers.1.mlp.experts.1.gate_proj", INTER, HIDDEN)


def _scale_missing(t):
    del t["language_model.model.layers.1.mlp.experts.3.gate_proj.weight_scale"]


def _ignored_stored_int8(t):
    t |= plain("language_model.model.layers.0.self_attn.o_proj", HIDDEN, HIDDEN, dtype=torch.int8)


@pytest.mark.parametrize(
    "mutate, rule",
    [
        (_attention_packed, "ignored-module-packed"),
        (_expert_unpacked, "targeted-module-unpacked"),
        (_shape_values_wrong, "packed-layout"),
        (_half_quantized, "half-quantized"),
        (_scale_missing, "packed-layout"),
        (_ignored_stored_int8, "ignored-module-dtype"),
    ],
)
def test_each_broken_layout_is_a_named_violation(tmp_path, mutate, rule):
    tensors = kimi_like_tensors()
    mutate(tensors)
    report = validate_checkpoint(write(tmp_path / "m", tensors))
    assert report.verdict == "fail"
    assert rule in rules(report)


def test_group_size_in_config_must_match_stored_scales(tmp_path):
    quant = quantization_config(KIMI_IGNORE)
    quant["config_groups"]["group_0"]["weights"]["group_size"] = 64
    report = validate_checkpoint(write(tmp_path / "m", kimi_like_tensors(), quant=quant))
    assert rules(report) == {"packed-layout"}
    assert "expected [32, 1]" in report.violations[0].message


def test_int64_weight_shape_from_compressed_tensors_is_accepted(tmp_path):
    tensors = kimi_like_tensors()
    tensors |= packed("language_model.model.layers.1.mlp.experts.0.down_proj", HIDDEN, INTER, shape_dtype=torch.int64)
    assert validate_checkpoint(write(tmp_path / "m", tensors)).verdict == "pass"


def test_stale_ignore_entry_is_a_warning_not_a_failure(tmp_path):
    report = validate_checkpoint(write(tmp_path / "m", kimi_like_tensors(), ignore=KIMI_IGNORE + ["re:.*mtp.*"]))
    assert report.verdict == "pass"
    assert [(w.rule, w.module) for w in report.warnings] == [("stale-ignore", "re:.*mtp.*")]


def _llama_attention(q_ignored_only: bool) -> tuple[dict, list[str]]:
    t = {}
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}"
        t |= plain(name, HIDDEN, HIDDEN) if (proj == "q_proj" or not q_ignored_only) else packed(name, HIDDEN, HIDDEN)
    t |= packed("model.layers.0.self_attn.o_proj", HIDDEN, HIDDEN)
    ignore = ["re:.*q_proj$"] if q_ignored_only else ["model.layers.0.self_attn.qkv_proj"]
    return t, ignore


def test_ignore_entry_naming_a_fused_module_covers_its_parts(tmp_path):
    tensors, ignore = _llama_attention(q_ignored_only=False)
    report = validate_checkpoint(write(tmp_path / "m", tensors, ignore=ignore))
    assert report.verdict == "pass", report.violations
    assert report.warnings == []


def test_fused_parts_that_disagree_fail(tmp_path):
    tensors, ignore = _llama_attention(q_ignored_only=True)
    report = validate_checkpoint(write(tmp_path / "m", tensors, ignore=ignore))
    assert "fused-parts-disagree" in rules(report)
    assert any(v.module == "model.layers.0.self_attn.qkv_proj" for v in report.violations)


def test_model_without_quantization_config_passes_with_a_note(tmp_path):
    report = validate_checkpoint(write(tmp_path / "m", kimi_like_tensors(), quant=None))
    assert report.verdict == "pass"
    assert report.quant_method is None
    assert "no quantization_config" in report.notes[0]


def test_missing_required_field_names_it(tmp_path):
    quant = quantization_config(KIMI_IGNORE)
    del quant["config_groups"]
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.config_groups"):
        validate_checkpoint(write(tmp_path / "m", kimi_like_tensors(), quant=quant))


def test_demo_checkpoints_from_the_real_quantizer_layout(hub_root):
    bf16 = validate_checkpoint(hub_root / BF16_REPO)
    int4 = validate_checkpoint(hub_root / INT4_REPO)
    assert bf16.verdict == "pass" and bf16.modules_packed == 0
    assert int4.verdict == "pass", int4.violations
    assert int4.modules_packed == 3 * 8  # one MoE layer, 8 experts, gate/up/down each
    assert int4.warnings == []


@pytest.mark.parametrize(
    "name, target",
    [
        ("model.layers.3.self_attn.q_proj", "re:.*self_attn.*"),
        ("model.layers.3.self_attn.q_proj", "re:self_attn"),  # anchored at the start: no match
        ("model.layers.3.self_attn.q_proj", "re:.*q_proj$"),
        ("lm_head", "lm_head"),
        ("language_model.lm_head", "lm_head"),
        ("model.layers.10.mlp.gate", r"re:model\.layers\.1\.mlp.*"),
        ("model.layers.1.mlp.gate", r"re:model\.layers\.1\.mlp.*"),
    ],
)
def test_name_matching_agrees_with_compressed_tensors(name, target):
    ct = pytest.importorskip("compressed_tensors.utils.match")
    assert match_name(name, target) == ct.match_name(name, target)


def test_fused_matching_agrees_with_compressed_tensors_for_agreeing_parts():
    ct = pytest.importorskip("compressed_tensors.utils.match")
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    target = "re:.*self_attn.*"
    for part in ("q_proj", "k_proj", "v_proj"):
        ours = any(match_name(n, target) for n in engine_names(f"model.layers.0.self_attn.{part}"))
        assert ours == ct.match_name("model.layers.0.self_attn.qkv_proj", target, fused)


runner = CliRunner()


def test_cli_json_pass_exit_0(hub_root):
    result = runner.invoke(app, ["validate", str(hub_root / INT4_REPO), "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["verdict"] == "pass" and body["violations"] == []


def test_cli_json_violations_exit_1(tmp_path):
    tensors = kimi_like_tensors()
    _attention_packed(tensors)
    result = runner.invoke(app, ["validate", str(write(tmp_path / "m", tensors)), "--json"])
    assert result.exit_code == 1
    body = json.loads(result.stdout)
    assert body["verdict"] == "fail"
    assert body["violations"][0]["rule"] == "ignored-module-packed"


def test_cli_missing_dir_exit_2(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path / "nope"), "--json"])
    assert result.exit_code == 2
    assert "not a directory" in result.stderr


def test_cli_bad_json_exit_2_names_the_file(tmp_path):
    model = write(tmp_path / "m", kimi_like_tensors())
    (model / "config.json").write_text("{not json")
    result = runner.invoke(app, ["validate", str(model), "--json"])
    assert result.exit_code == 2
    assert re.search(r"config\.json: not valid JSON", result.stderr)
