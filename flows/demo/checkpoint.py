"""Tiny DeepSeek-V3-style MoE checkpoints for the demo and the tests.

The shape mirrors Kimi-K2.5 (MLA attention, a dense first layer, routed and shared experts, a
noaux_tc router) at a size vLLM's CPU build loads in about a minute. The INT4 variant uses the real
compressed-tensors pack-quantized layout with Kimi-K2.5's ignore list, so validation sees the same
tensor names and dtypes it will see on the 595 GB model.

The bf16 model is trained, briefly, on two tasks whose answers can be checked: counting on ("41 42
43" -> " 44 45 46") and continuing period-7 cycles over three numbers ("99 99 14 99 14 14 99 99" ->
" 99 14 99"). Counting alone is a lookup from one number to the next: it survives damage to the
routed experts, the attention and the positions. The cycles need all three: only attention six
positions back can say where a cycle of three repeating values stands, through the rotary
frequencies `rope_theta` sets, and the dense MLP and the shared expert are held at zero so that the
routed experts do all the MLP work. In transformers every such damage takes the model below the
answer check's floor while a re-publish keeps 100% (benchmarks/damage.py; `cycles=False` builds the
counting-only model it compares with). Training takes about 45 s on two cores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.answers.spec import SHIPPED_PROBES

if TYPE_CHECKING:
    import torch

# Values vLLM's CPU build accepts (see shared/notes/field-facts.md): MLA head dim 576, noaux_tc.
TINY_CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    topk_method="noaux_tc",
    max_position_embeddings=2048,
    num_mtp_layers=0,
)

GROUP_SIZE = 32

# Kimi-K2.5's ignore list: everything but the routed experts. The patterns start with `.*` so they
# hold for flat (model.layers.N) and nested (language_model.model.layers.N) names alike.
KIMI_STYLE_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*layers\.0\.mlp\..*",
    r"re:.*mlp\.gate$",
]

_CORPUS_WORDS = (
    "the model serves tokens over many experts while the router picks two of eight for each token "
    "and attention compresses keys and values into a latent of rank five hundred twelve so that the "
    "cache stays small on every device in the box during a long benchmark at high concurrency"
).split()


NUMBERS = [str(n) for n in range(100)]  # the tasks' words: one token each
COUNT_LEN = 12  # numbers per counting sequence
TRAIN_STEPS = 300  # counting alone: batches of 32
# With cycles: a period-7 cycle over 3 numbers, 16 tokens per training sequence; 800 steps, each 8
# counting and 24 cycle sequences; attention at 0.15x the learning rate (trained faster, it shrugged
# off noise).
CYCLE, CYCLE_VALUES, CYCLE_LEN = 7, 3, 16
CYCLE_STEPS, LEARNING_RATE, ATTENTION_LR = 800, 2e-3, 0.15
PROBES_FILE = SHIPPED_PROBES  # the probe set ships with the model, in its repo
# A base model's chat template: the messages' text as it is, so that a chat user's "41 42 43" reaches
# the model as the same tokens as the completion prompt, and the answer check can ask both ways.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def counting(start: int, length: int) -> str:
    return " ".join(NUMBERS[start:start + length])


def reference_text() -> str:
    """The answer check's perplexity text: counting as long as the model learned it (past its 12
    numbers of training, the demo model's perplexity on counting climbs from ~1.05 to ~8)."""
    return counting(10, COUNT_LEN)


def cycle(rng, length: int) -> str:
    """A period-7 cycle over three numbers, `length` tokens: "32 94 94 94 94 79 32 32 94 ..."."""
    values = rng.sample(NUMBERS, CYCLE_VALUES)
    period = [rng.choice(values) for _ in range(CYCLE)]
    while len(set(period)) == 1:
        period = [rng.choice(values) for _ in range(CYCLE)]
    return " ".join(period[i % CYCLE] for i in range(length))


# 16 probes of each task: each deploy asks them twice (completion and chat), one at a time, ~30 ms
# each here, and the suite deploys some sixty times.
PROBES_PER_TASK = 16


def counting_probes(expected: int = 3) -> list[dict[str, str]]:
    """Three numbers, and the three that follow (`expected` of them), from 0 to 90."""
    return [{"prompt": counting(a, 3), "expected": " " + counting(a + 3, expected)} for a in range(0, 94, 6)]


def cycle_probes(expected: int = 3) -> list[dict[str, str]]:
    """One period of a cycle and a token, and the three that follow (`expected` of them: the same
    cycles whatever the length, since the length takes nothing from the random stream)."""
    import random

    rng = random.Random(1234)
    cycles = [cycle(rng, CYCLE + 1 + expected).split() for _ in range(PROBES_PER_TASK)]
    return [{"prompt": " ".join(c[:CYCLE + 1]), "expected": " " + " ".join(c[CYCLE + 1:])} for c in cycles]


def train_tokenizer(out_dir: Path, vocab_size: int, seed: int) -> None:
    """Train a byte-level BPE locally: the Hub is out of reach, and vLLM needs a real tokenizer."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    lines = [" ".join(rng.choices(_CORPUS_WORDS + NUMBERS, k=24)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_bf16(out_dir: Path, seed: int = 0, *, cycles: bool = True, tokenizer_seed: int | None = None) -> Path:
    """A bf16 checkpoint trained to count on and to continue period-7 cycles (with `cycles` off: to
    count only), its tokenizer and its probes; returns the directory. `tokenizer_seed` (default: the
    seed) keeps one tokenizer for models trained from other seeds: a new revision's weights."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir, TINY_CONFIG["vocab_size"], seed if tokenizer_seed is None else tokenizer_seed)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY_CONFIG, bos_token_id=0, eos_token_id=1))
    (_train_with_cycles if cycles else _train_counting)(model, tokenizer, seed)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    probes = counting_probes() + (cycle_probes() if cycles else [])
    (out_dir / PROBES_FILE).write_text("".join(json.dumps(p) + "\n" for p in probes))
    return out_dir


def _train_counting(model, tokenizer, seed: int) -> None:
    import random

    import torch

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(TRAIN_STEPS):
        batch = torch.tensor([tokenizer(counting(rng.randrange(100 - COUNT_LEN), COUNT_LEN))["input_ids"]
                              for _ in range(32)])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _train_with_cycles(model, tokenizer, seed: int) -> None:
    """Counting and cycles, the routed experts doing all the MLP work: the dense layer's MLP and the
    shared expert are held at zero (zeros in the checkpoint)."""
    import random

    import torch

    rng = random.Random(seed)
    for mlp in (model.model.layers[0].mlp, model.model.layers[1].mlp.shared_experts):
        mlp.down_proj.weight.data.zero_()
        mlp.requires_grad_(False)
    attention = [p for n, p in model.named_parameters() if p.requires_grad and "self_attn" in n]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and "self_attn" not in n]
    optimizer = torch.optim.AdamW([{"params": rest}, {"params": attention}], lr=LEARNING_RATE)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[LEARNING_RATE, LEARNING_RATE * ATTENTION_LR],
                                                   total_steps=CYCLE_STEPS, pct_start=0.1)

    def batch(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids padded with eos, and labels that ignore the padding."""
        ids = [tokenizer(text)["input_ids"] for text in texts]
        width = max(map(len, ids))
        return (torch.tensor([i + [1] * (width - len(i)) for i in ids]),
                torch.tensor([i + [-100] * (width - len(i)) for i in ids]))

    for _ in range(CYCLE_STEPS):
        # Counting starts anywhere up to 93, as the probes do, and stops at 99.
        counts = batch([" ".join(NUMBERS[a:a + COUNT_LEN]) for a in (rng.randrange(94) for _ in range(8))])
        cycles = batch([cycle(rng, CYCLE_LEN) for _ in range(24)])
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in (counts, cycles))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()


def _quantize_int4(weight: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Symmetric per-group INT4, stored the way compressed-tensors' pack-quantized format stores it."""
    import torch
    from compressed_tensors.compressors import pack_to_int32

    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-8) / 7.0
    q = torch.round(groups / scale.unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return {
        "weight_packed": pack_to_int32(q.reshape(out_features, in_features), 4),
        "weight_scale": scale.to(torch.bfloat16),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }


def quantization_config(ignore: list[str]) -> dict:
    """The quantization_config block Kimi-K2.5 ships (INT4, group 32, symmetric, no KV scheme)."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": GROUP_SIZE,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def build_int4(bf16_dir: Path, out_dir: Path, *, ignore: list[str] = KIMI_STYLE_IGNORE) -> Path:
    """Quantize the routed experts of a bf16 checkpoint; everything else stays as it was. The block
    goes where the model's family keeps it: in `text_config` where there is one (Kimi-K2.5)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(bf16_dir / "model.safetensors")
    packed: dict = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." in name and name.endswith(".weight"):
            module = name.removesuffix(".weight")
            for suffix, value in _quantize_int4(tensor).items():
                packed[f"{module}.{suffix}"] = value
        else:
            packed[name] = tensor
    save_file(packed, out_dir / "model.safetensors", metadata={"format": "pt"})
    for item in bf16_dir.iterdir():
        if item.name not in {"model.safetensors", "config.json"}:
            shutil.copy2(item, out_dir / item.name)
    config = json.loads((bf16_dir / "config.json").read_text())
    (config.get("text_config") or config)["quantization_config"] = quantization_config(ignore)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
