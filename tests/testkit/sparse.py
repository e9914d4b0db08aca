"""Kimi-K2.5-sized checkpoints as sparse files: real headers, hundreds of GB apparent, almost no disk.

Validation reads headers and the weight_shape values only, so those are the only bytes written;
every shard's data section starts with its small integer tensors so their values fit in one block.
Names, shapes and dtypes follow Kimi-K2.5 INT4 (nested text model, MLA, dense layer 0, 384 routed
INT4 experts per MoE layer, bf16 everything else, an unquantized vision tower).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from flows.demo.checkpoint import KIMI_STYLE_IGNORE, quantization_config
from tasks.checkpoint.headers import DTYPE_BYTES


@dataclass(frozen=True)
class KimiShape:
    layers: int = 61
    experts: int = 384
    hidden: int = 7168
    moe_intermediate: int = 2048
    dense_intermediate: int = 18432
    vocab: int = 163840
    heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    shards: int = 64


def _tensors_by_layer(s: KimiShape) -> list[list[tuple[str, str, list[int], tuple[int, ...] | None]]]:
    """(name, dtype, shape, int values) grouped: [embeddings+vision, layer 0, ..., layer N-1, head]."""
    lm = "language_model"
    bf16 = lambda n, *shape: (n, "BF16", list(shape), None)  # noqa: E731
    groups = [[bf16(f"{lm}.model.embed_tokens.weight", s.vocab, s.hidden),
               bf16("vision_tower.encoder.blocks.0.attn.qkv.weight", 3 * 1152, 1152),
               bf16("mm_projector.proj.0.weight", s.hidden, 1152 * 4)]]
    for layer in range(s.layers):
        p = f"{lm}.model.layers.{layer}"
        g = [
            bf16(f"{p}.input_layernorm.weight", s.hidden),
            bf16(f"{p}.post_attention_layernorm.weight", s.hidden),
            bf16(f"{p}.self_attn.q_a_proj.weight", s.q_lora_rank, s.hidden),
            bf16(f"{p}.self_attn.q_a_layernorm.weight", s.q_lora_rank),
            bf16(f"{p}.self_attn.q_b_proj.weight", s.heads * (s.qk_nope + s.qk_rope), s.q_lora_rank),
            bf16(f"{p}.self_attn.kv_a_proj_with_mqa.weight", s.kv_lora_rank + s.qk_rope, s.hidden),
            bf16(f"{p}.self_attn.kv_a_layernorm.weight", s.kv_lora_rank),
            bf16(f"{p}.self_attn.kv_b_proj.weight", s.heads * (s.qk_nope + s.v_head), s.kv_lora_rank),
            bf16(f"{p}.self_attn.o_proj.weight", s.hidden, s.heads * s.v_head),
        ]
        if layer == 0:
            g += [bf16(f"{p}.mlp.{n}.weight", *shape) for n, shape in
                  (("gate_proj", (s.dense_intermediate, s.hidden)), ("up_proj", (s.dense_intermediate, s.hidden)),
                   ("down_proj", (s.hidden, s.dense_intermediate)))]
        else:
            g += [bf16(f"{p}.mlp.gate.weight", s.experts, s.hidden),
                  (f"{p}.mlp.gate.e_score_correction_bias", "F32", [s.experts], None)]
            shapes = {"gate_proj": (s.moe_intermediate, s.hidden), "up_proj": (s.moe_intermediate, s.hidden),
                      "down_proj": (s.hidden, s.moe_intermediate)}
            g += [bf16(f"{p}.mlp.shared_experts.{n}.weight", *shape) for n, shape in shapes.items()]
            for e in range(s.experts):
                for n, (out_f, in_f) in shapes.items():
                    m = f"{p}.mlp.experts.{e}.{n}"
                    g += [(f"{m}.weight_packed", "I32", [out_f, in_f // 8], None),
                          (f"{m}.weight_scale", "BF16", [out_f, in_f // 32], None),
                          (f"{m}.weight_shape", "I32", [2], (out_f, in_f))]
        groups.append(g)
    groups.append([bf16(f"{lm}.model.norm.weight", s.hidden), bf16(f"{lm}.lm_head.weight", s.vocab, s.hidden)])
    return groups


def _write_shard(path: Path, tensors: list[tuple[str, str, list[int], tuple[int, ...] | None]]) -> int:
    """Small integer tensors first, so their real values are the only data bytes on disk."""
    ordered = sorted(tensors, key=lambda t: t[3] is None)
    header, offset, values = {"__metadata__": {"format": "pt"}}, 0, bytearray()
    for name, dtype, shape, vals in ordered:
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        if vals is not None:
            values += struct.pack(f"<{len(vals)}i", *vals)
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + bytes(values))
        fh.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


def write_sparse_kimi(out_dir: Path, shape: KimiShape = KimiShape()) -> int:
    """Write config.json, the index and `shape.shards` sparse shards; returns the apparent size."""
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = _tensors_by_layer(shape)
    # Shard 1 holds embeddings and the dense layer, as Kimi-K2.5's small first shard does; the rest
    # of the tensors are cut into equal-byte runs, one per remaining shard.
    rest = [t for g in groups[2:] for t in g]
    nbytes = [math.prod(t[2]) * DTYPE_BYTES[t[1]] for t in rest]
    budget = sum(nbytes) / (shape.shards - 1)
    per_shard: list[list] = [[t for g in groups[:2] for t in g]] + [[] for _ in range(shape.shards - 1)]
    done = 0
    for t, size in zip(rest, nbytes):
        per_shard[1 + min(int(done // budget), shape.shards - 2)].append(t)
        done += size
    weight_map, total = {}, 0
    for i, tensors in enumerate(per_shard):
        name = f"model-{i + 1:05d}-of-{shape.shards:05d}.safetensors"
        total += _write_shard(out_dir / name, tensors)
        weight_map |= {t[0]: name for t in tensors}
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    text_config = {
        "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": shape.layers,
        "n_routed_experts": shape.experts, "hidden_size": shape.hidden, "vocab_size": shape.vocab,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 0, "kv_lora_rank": shape.kv_lora_rank,
    }
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text_config, "quantization_config": quantization_config(KIMI_STYLE_IGNORE)}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return total
