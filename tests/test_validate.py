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
from tasks.checkpoint.names import IgnoreMatcher, engine_names, match_name
from tasks.checkpoint.rules import validate_checkpoint, validate_remote
from tasks.errors import CheckpointError
from testkit.faulty_hub import FaultyHub
from testkit.sparse import write_sparse_kimi

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


def write(dir_: Path, tensors: dict, ignore=KIMI_IGNORE, quant: dict | None | str = "default", layers: int = 2) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dir_ / "model.safetensors")
    config = {"architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": {"vocab_size": 128, "num_hidden_layers": layers, "n_routed_experts": EXPERTS}}
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
    report = validate_checkpoint(write(tmp_path / "m", tensors, ignore=ignore, layers=1))
    assert report.verdict == "pass", report.violations
    assert report.warnings == []


def test_fused_parts_that_disagree_fail(tmp_path):
    tensors, ignore = _llama_attention(q_ignored_only=True)
    report = validate_checkpoint(write(tmp_path / "m", tensors, ignore=ignore, layers=1))
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



_NAMES = ["model.layers.3.self_attn.q_proj", "model.layers.10.mlp.gate", "model.layers.1.mlp.gate", "lm_head",
          "language_model.lm_head", "model.layers.1.mlp.experts.7.down_proj", "mlp", "model.layers.1.mlp.gate_x",
          "vision_tower.blocks.0.attn.qkv"]


@pytest.mark.parametrize("entry", [
    "re:.*self_attn.*", "re:self_attn", "re:.*q_proj$", r"re:.*mlp\.gate$", r"re:model\.layers\.1\.mlp.*",
    "re:.*?gate", r"re:.*gate|lm_head", "re:.*", "re:^mlp$", r"re:.*gate(?![\s\S])", r"re:.*gate\Z",
    r"re:.*(?<=mlp\.)gate", "re:.*experts.[0-9]+.down", "re:(?s).*gate", "re:.*+gate", r"re:.*gate\s?$", "lm_head",
])
def test_ignore_matcher_finds_exactly_what_match_name_finds(entry):
    """The joined-text scan may only speed match_name up: every name, every entry, the same answer."""
    names = _NAMES + _NAMES[::-1]
    found = IgnoreMatcher([entry]).hits(names)
    assert {i for i, hit in found.items() if hit} == {i for i, n in enumerate(names) if match_name(n, entry)}


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


def _split(dir_: Path, tensors: dict, names: list[str], weight_map_edit=None) -> Path:
    """Two shards plus an index, the way sharded checkpoints are stored."""
    write(dir_, {})
    (dir_ / "model.safetensors").unlink()
    keys = sorted(tensors)
    half = len(keys) // 2
    parts = {names[0]: keys[:half], names[1]: keys[half:]}
    weight_map = {}
    for file, ks in parts.items():
        save_file({k: tensors[k] for k in ks}, dir_ / file)
        weight_map |= {k: file for k in ks}
    if weight_map_edit:
        weight_map_edit(weight_map)
    (dir_ / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dir_


SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_sharded_checkpoint_with_a_true_index_passes(tmp_path):
    assert validate_checkpoint(_split(tmp_path / "m", kimi_like_tensors(), SHARDS)).verdict == "pass"


def test_index_naming_a_missing_shard_fails(tmp_path):
    model = _split(tmp_path / "m", kimi_like_tensors(), SHARDS)
    (model / SHARDS[1]).unlink()
    report = validate_checkpoint(model)
    assert ("weight-map-missing-file", SHARDS[1]) in {(v.rule, v.module) for v in report.violations}


def test_shard_the_index_never_names_fails(tmp_path):
    model = _split(tmp_path / "m", kimi_like_tensors(), SHARDS)
    save_file({"stray.weight": torch.zeros(2)}, model / "model-00003-of-00002.safetensors")
    report = validate_checkpoint(model)
    assert ("shard-not-in-weight-map", "model-00003-of-00002.safetensors") in {(v.rule, v.module) for v in report.violations}


def test_index_pointing_at_the_wrong_shard_fails(tmp_path):
    def move_one(weight_map):
        name = next(k for k, v in weight_map.items() if v == SHARDS[0])
        weight_map[name] = SHARDS[1]

    report = validate_checkpoint(_split(tmp_path / "m", kimi_like_tensors(), SHARDS, move_one))
    assert "weight-map-mismatch" in rules(report)


@pytest.mark.parametrize("field, value, rule", [("num_hidden_layers", 3, "config-layer-count"),
                                                ("n_routed_experts", 8, "config-expert-count")])
def test_config_counts_must_describe_the_tensors(tmp_path, field, value, rule):
    model = write(tmp_path / "m", kimi_like_tensors())
    config = json.loads((model / "config.json").read_text())
    config["text_config"][field] = value
    (model / "config.json").write_text(json.dumps(config))
    assert rule in rules(validate_checkpoint(model))


def _publish(root: Path, repo: str, tensors: dict) -> Path:
    return write(root / repo, tensors)


@pytest.mark.parametrize("mutate", [None, _attention_packed, _expert_unpacked, _scale_missing])
def test_hub_headers_by_range_requests_give_the_local_verdict(tmp_path, mutate):
    tensors = kimi_like_tensors()
    if mutate:
        mutate(tensors)
    model = _split(tmp_path / "hub" / "org" / "kimi", tensors, SHARDS)
    local = validate_checkpoint(model)
    with FaultyHub(tmp_path / "hub") as hub:
        remote = validate_remote("org/kimi", "main", hub.endpoint)
        sent = hub.file_bytes_sent
    assert remote.verdict == local.verdict
    assert [(v.rule, v.module) for v in remote.violations] == [(v.rule, v.module) for v in local.violations]
    assert remote.summary == local.summary
    shard_bytes = sum((model / s).stat().st_size for s in SHARDS)
    assert remote.bytes_read == sent  # every byte read came from the hub, and only those
    assert sent < shard_bytes / 4  # headers and config only, never the tensor data


def test_cli_validates_a_repo_id_before_download(tmp_path):
    model = _split(tmp_path / "hub" / "org" / "kimi", kimi_like_tensors(), SHARDS)
    with FaultyHub(tmp_path / "hub") as hub:
        remote = runner.invoke(app, ["validate", "org/kimi", "--endpoint", hub.endpoint, "--json"])
        missing = runner.invoke(app, ["validate", "org/absent", "--endpoint", hub.endpoint, "--json"])
    local = runner.invoke(app, ["validate", str(model), "--json"])
    assert remote.exit_code == local.exit_code == 0, remote.output
    assert json.loads(remote.stdout)["verdict"] == json.loads(local.stdout)["verdict"] == "pass"
    assert missing.exit_code == 2 and "org/absent not found" in missing.stderr


def test_kimi_sized_sparse_checkpoint_reads_under_a_ten_thousandth(tmp_path):
    total = write_sparse_kimi(tmp_path / "kimi")
    assert total > 500 * 10**9
    report = validate_checkpoint(tmp_path / "kimi")
    assert report.verdict == "pass", report.violations[:3]
    assert report.files == 64 and report.modules_packed == 60 * 384 * 3
    assert report.bytes_read / total < 1e-4
    roles = {(r["role"], r["storage"]) for r in report.summary}
    assert ("routed expert", "packed") in roles and ("attention", "unquantized") in roles


def test_planted_violation_in_the_kimi_sized_checkpoint_is_found(tmp_path):
    model = tmp_path / "kimi"
    write_sparse_kimi(model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"]["ignore"].remove("re:.*shared_experts.*")
    (model / "config.json").write_text(json.dumps(config))
    report = validate_checkpoint(model)
    assert rules(report) == {"targeted-module-unpacked"}
    assert len(report.violations) == 60 * 3  # every shared-expert projection of every MoE layer
