"""Which damage a model's probes see: the demo's counting model, and the model trained with cycles
too (`build_bf16(cycles=True)`), each damaged in every way the answer check must catch, every copy
scored side by side in one run on the probes that ship with it (accuracy per task, and the
reference text's perplexity against the healthy copy's).

The damages: the routed experts scaled (all experts' gate and up projections x8, or their down
projections x8), noise on the attention weights (1 standard deviation), `rope_theta` x1000 in the
config alone, and the two layers swapped; a re-publish (the same weights) is the control. Scored
with transformers in bf16 weights (the checkpoint's), greedy, as the answer check's completions are.
Run from the repository root (about two minutes on two cores):

    .venv/bin/python benchmarks/damage.py
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding  # noqa: E402

from flows.demo.checkpoint import PROBES_FILE, build_bf16, counting, cycle  # noqa: E402


def score(model, tokenizer, probes: list[dict], reference: list[list[int]]) -> dict[str, float]:
    """Accuracy of the counting and the cycle probes (their continuation exact), and perplexity."""
    right: dict[str, list[bool]] = {"counting": [], "cycles": []}
    with torch.no_grad():
        for i, probe in enumerate(probes):
            ids = tokenizer(probe["prompt"], return_tensors="pt")["input_ids"]
            expected = tokenizer(probe["expected"])["input_ids"]
            out = model.generate(ids, max_new_tokens=len(expected), do_sample=False, pad_token_id=1)
            right["counting" if i < 32 else "cycles"].append(out[0, ids.shape[1]:].tolist() == expected)
        losses = [model(input_ids=torch.tensor([r]), labels=torch.tensor([r])).loss for r in reference]
    figures = {task: sum(ok) / len(ok) if ok else None for task, ok in right.items()}
    figures["all"] = sum(sum(ok) for ok in right.values()) / len(probes)
    figures["perplexity"] = float(torch.exp(torch.stack(losses).mean()))
    return figures


def experts(factor: float, *projections: str):
    def damage(model) -> None:
        for name, p in model.named_parameters():
            if ".mlp.experts." in name and any(proj in name for proj in projections):
                p.data *= factor
    return damage


def attention_noise(std: float):
    def damage(model) -> None:
        generator = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "self_attn" in name and p.dim() == 2:
                p.data += std * p.data.float().std().to(p.dtype) * torch.randn(p.shape, generator=generator).to(p.dtype)
    return damage


def rope_theta(factor: float):
    def damage(model) -> None:
        config = copy.deepcopy(model.config)
        config.rope_parameters = dict(config.rope_parameters, rope_theta=config.rope_parameters["rope_theta"] * factor)
        model.model.rotary_emb = DeepseekV3RotaryEmbedding(config=config)
    return damage


def swap_layers(model) -> None:
    layers = model.model.layers
    layers[0], layers[1] = layers[1], layers[0]


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def main() -> None:
    import random

    damages = [("healthy", None), ("re-published (same weights)", lambda m: None),
               ("routed experts gate+up x8", experts(8.0, "gate_proj", "up_proj")),
               ("routed experts down x8", experts(8.0, "down_proj")),
               ("attention noise 1 std", attention_noise(1.0)),
               ("rope_theta x1000 (config)", rope_theta(1000)),
               ("layers swapped", swap_layers)]
    for cycles in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            out = build_bf16(Path(tmp) / "model", cycles=cycles)
            built_s = time.perf_counter() - started
            tokenizer = AutoTokenizer.from_pretrained(out)
            healthy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
            probes = [json.loads(line) for line in (out / PROBES_FILE).read_text().splitlines()]
        rng = random.Random(99)
        texts = [counting(10, 40)] + ([cycle(rng, 40) for _ in range(4)] if cycles else [])
        reference = [tokenizer(text)["input_ids"] for text in texts]
        print(f"\n{'counting and cycles' if cycles else 'counting (the demo model)'}: built in {built_s:.0f} s, "
              f"{len(probes)} probes")
        print(f"{'copy':30s} {'counting':>9s} {'cycles':>7s} {'all':>5s} {'perplexity':>11s} {'x healthy':>10s}")
        base = score(healthy, tokenizer, probes, reference)
        for name, damage in damages:
            model = healthy if damage is None else copy.deepcopy(healthy)
            if damage is not None:
                damage(model)
            f = base if damage is None else score(model, tokenizer, probes, reference)
            print(f"{name:30s} {pct(f['counting']):>9s} {pct(f['cycles']):>7s} {pct(f['all']):>5s} "
                  f"{f['perplexity']:11.2f} {f['perplexity'] / base['perplexity']:10.2f}", flush=True)
    print("\nThe answer check fails a revision below 80% of probes right, 10 points below the last good one, "
          "or with probes flipped right-to-wrong beyond chance (docs/answer-check.md).")


if __name__ == "__main__":
    main()
