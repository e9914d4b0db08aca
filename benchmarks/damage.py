"""Which damage a model's probes see: a model trained to count only (`build_bf16(cycles=False)`, the
demo's model until issue 28), and the demo's model, trained on counting and cycles, each damaged in
every way the answer check must catch, every copy scored side by side in one run on the probes that
ship with it (accuracy per task, and the reference text's perplexity against the healthy copy's).

The damages: the routed experts scaled (all experts' gate and up projections x8, or their down
projections x8), noise on the attention weights (1 standard deviation), `rope_theta` x1000 in the
config alone, and the two layers swapped; a re-publish (the same weights) is the control. Scored
with transformers in bf16 weights (the checkpoint's), greedy, as the answer check's completions are.
With `--blind-spot`, the demo model alone against the answer check's blind spot (issue 39: a damage
that changes only the continuation after a probe's expected tokens), the two candidate rules side by
side: the probes scored on their whole continuation (6 counting numbers, 8 cycle values: as long as
the model was trained on), and the reference texts' per-token log-probabilities compared with the
healthy copy's by a paired sign test (one-sided: more tokens less likely than more likely), with the
mean change in nats per token as its effect; a copy retrained from another seed (different weights,
the same skills) is the legitimate new revision.
With `--served`, each copy is also written as a checkpoint and served by vLLM (the CPU build here, as
the deploy launches it), and asked by the answer check's own code: the figures a deploy would see.
The two layers cannot trade places in a checkpoint (the first is dense, the second MoE): served,
their attention is swapped instead. Run from the repository root (about two minutes on two cores;
eight more with `--served`):

    .venv/bin/python benchmarks/damage.py [--served | --blind-spot]
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

from flows.demo.checkpoint import (CYCLE_LEN, PROBES_FILE, PROBES_PER_TASK, build_bf16, counting_probes,  # noqa: E402
                                   cycle, cycle_probes, reference_text)


def score(model, tokenizer, probes: list[dict], reference: list[list[int]]) -> dict[str, float]:
    """Accuracy of the counting and the cycle probes (their continuation exact), and perplexity."""
    right: dict[str, list[bool]] = {"counting": [], "cycles": []}
    with torch.no_grad():
        for i, probe in enumerate(probes):
            ids = tokenizer(probe["prompt"], return_tensors="pt")["input_ids"]
            expected = tokenizer(probe["expected"])["input_ids"]
            out = model.generate(ids, max_new_tokens=len(expected), do_sample=False, pad_token_id=1)
            right["counting" if i < PROBES_PER_TASK else "cycles"].append(out[0, ids.shape[1]:].tolist() == expected)
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
    """In the config alone: the model's own rotary embedding rebuilt from it, and a saved copy carries it."""
    def damage(model) -> None:
        parameters = model.config.rope_parameters
        model.config.rope_parameters = dict(parameters, rope_theta=parameters["rope_theta"] * factor)
        model.model.rotary_emb = DeepseekV3RotaryEmbedding(config=model.config)
    return damage


def swap_layers(model) -> None:
    layers = model.model.layers
    layers[0], layers[1] = layers[1], layers[0]


def swap_attention(model) -> None:
    layers = model.model.layers
    layers[0].self_attn, layers[1].self_attn = layers[1].self_attn, layers[0].self_attn


def served_score(model, tokenizer, probes: list[dict], reference_text: str) -> dict[str, float]:
    """The copy saved and served by vLLM as a deploy launches it on this host, asked by the answer
    check's own code (completions, greedy) for its accuracy per task and the reference's perplexity."""
    from flows.demo import demo_config
    from tasks.answers.check import Probe, ask, perplexity
    from tasks.deployment.stages import server_config
    from tasks.vllm.process import stop_server
    from tasks.vllm.readiness import start_and_wait

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        # The demo's own launch of this model (its engine settings, the CPU's MLA fix, the compile cache).
        form = demo_config("http://127.0.0.1:1", Path(tmp) / "models", served_model_name="damaged")
        cfg = server_config(form, folder, "cpu")
        handle = start_and_wait(cfg, Path(tmp) / "run", timeout_s=600)
        try:
            results = ask(handle.base_url, "damaged", [Probe(**p) for p in probes], max_tokens=6)
            ppl = perplexity(handle.base_url, "damaged", reference_text)
        finally:
            stop_server(handle)
    right = {"counting": [r.correct for r in results[:PROBES_PER_TASK]],
             "cycles": [r.correct for r in results[PROBES_PER_TASK:]]}
    figures = {task: sum(ok) / len(ok) if ok else None for task, ok in right.items()}
    return figures | {"all": sum(r.correct for r in results) / len(results), "perplexity": ppl or float("nan")}


def token_nll(model, reference: list[list[int]]) -> list[float]:
    """Each reference token's negative log-probability (after each text's first), in order."""
    values: list[float] = []
    with torch.no_grad():
        for ids in reference:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            values += (-torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]).tolist()
    return values


def blind_spot() -> None:
    """The two candidate rules on the demo model's damages, the continuation-only ones among them."""
    import random

    from tasks.answers.reference import reference_drift, sign_test
    from tasks.answers.spec import AnswerSpec

    long_probes = counting_probes(6) + cycle_probes(8)
    with tempfile.TemporaryDirectory() as tmp:
        out = build_bf16(Path(tmp) / "model")
        retrained = build_bf16(Path(tmp) / "retrained", seed=1, tokenizer_seed=0)
        tokenizer = AutoTokenizer.from_pretrained(out)
        healthy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
        other = AutoModelForCausalLM.from_pretrained(retrained, dtype=torch.bfloat16).eval()
        short = [json.loads(line) for line in (out / PROBES_FILE).read_text().splitlines()]
    rng = random.Random(99)
    reference = [tokenizer(text)["input_ids"] for text in [reference_text()] + [cycle(rng, CYCLE_LEN) for _ in range(4)]]
    base_nll = token_nll(healthy, reference)
    base_short = score(healthy, tokenizer, short, reference)
    spec = AnswerSpec()
    print(f"{'copy':34s} {'3 expected':>10s} {'whole':>6s} {'ppl x':>6s} {'nats/token':>10s} {'sign test p':>11s} "
          f"{'paired rule':>8s}")
    copies = [("healthy", lambda m: None), ("re-published (same weights)", lambda m: None),
              ("retrained, another seed (legit)", None),
              ("attention noise 0.4 std", attention_noise(0.4)), ("attention noise 0.5 std", attention_noise(0.5)),
              ("routed experts down x5", experts(5.0, "down_proj")),
              ("routed experts gate+up x2.5", experts(2.5, "gate_proj", "up_proj")),
              ("rope_theta x30 (config)", rope_theta(30)), ("attention noise 1 std", attention_noise(1.0))]
    for name, damage in copies:
        model = other if damage is None else copy.deepcopy(healthy)
        if damage is not None:
            damage(model)
        f_short = score(model, tokenizer, short, reference)
        f_long = score(model, tokenizer, long_probes, reference)
        new_nll = token_nll(model, reference)
        change, p, _, _ = sign_test(new_nll, base_nll)
        caught = reference_drift(new_nll, base_nll, max_p=spec.max_reference_p, min_change=spec.min_reference_change)
        print(f"{name:34s} {pct(f_short['all']):>10s} {pct(f_long['all']):>6s} "
              f"{f_short['perplexity'] / base_short['perplexity']:6.2f} {change:+10.3f} {p:11.2g} "
              f"{'caught' if caught else 'passes':>8s}", flush=True)


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def main() -> None:
    import random

    if "--blind-spot" in sys.argv[1:]:
        return blind_spot()
    served = "--served" in sys.argv[1:]
    damages = [("healthy", None), ("re-published (same weights)", lambda m: None),
               ("routed experts gate+up x8", experts(8.0, "gate_proj", "up_proj")),
               ("routed experts down x8", experts(8.0, "down_proj")),
               ("attention noise 1 std", attention_noise(1.0)),
               ("rope_theta x1000 (config)", rope_theta(1000)),
               ("layers swapped", swap_layers),
               ("the layers' attention swapped", swap_attention)]
    for cycles in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            out = build_bf16(Path(tmp) / "model", cycles=cycles)
            built_s = time.perf_counter() - started
            tokenizer = AutoTokenizer.from_pretrained(out)
            healthy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
            probes = [json.loads(line) for line in (out / PROBES_FILE).read_text().splitlines()]
        rng = random.Random(99)
        texts = [reference_text()] + ([cycle(rng, CYCLE_LEN) for _ in range(4)] if cycles else [])
        reference = [tokenizer(text)["input_ids"] for text in texts]
        print(f"\n{'the demo model: counting and cycles' if cycles else 'counting only'}: built in {built_s:.0f} s, "
              f"{len(probes)} probes")
        columns = f"{'counting':>9s} {'cycles':>7s} {'all':>5s} {'perplexity':>11s} {'x healthy':>10s}"
        print(f"{'':30s} {'transformers':^45s}" + (f" {'served by vLLM (CPU)':^45s}" if served else ""))
        print(f"{'copy':30s} {columns}" + (f" {columns}" if served else ""))
        base = score(healthy, tokenizer, probes, reference)
        served_base = served_score(healthy, tokenizer, probes, reference_text()) if served else None
        for name, damage in damages:
            model = healthy if damage is None else copy.deepcopy(healthy)
            if damage is not None:
                damage(model)
            f = base if damage is None else score(model, tokenizer, probes, reference)
            line = f"{name:30s} {figures(f, base)}"
            if served:
                servable = damage is not swap_layers
                g = (served_base if damage is None else served_score(model, tokenizer, probes, reference_text())
                     if servable else None)
                line += f" {figures(g, served_base) if g else 'not servable: a dense and an MoE layer':>45s}"
            print(line, flush=True)
    print("\nThe answer check fails a revision below 80% of probes right, 10 points below the last good one, "
          "or with probes flipped right-to-wrong beyond chance (docs/answer-check.md). Perplexity: served, the "
          "demo's reference text (counting, as long as trained) alone; in transformers, with four cycle "
          "texts beside it.")


def figures(f: dict[str, float], base: dict[str, float]) -> str:
    return (f"{pct(f['counting']):>9s} {pct(f['cycles']):>7s} {pct(f['all']):>5s} "
            f"{f['perplexity']:11.2f} {f['perplexity'] / base['perplexity']:10.2f}")


if __name__ == "__main__":
    main()
