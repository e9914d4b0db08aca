"""The tiny Kimi-K2.5's weights: its text model trained to answer its probes the ways a Kimi is
asked, the vision tower random, the INT4 variant in Kimi-K2.5's own compressed-tensors layout.

The text model is the demo's DeepSeek-V3 (tasks' names and rules hold for both), trained on four
kinds of text, each as Kimi's tokenizer and template render it:
- counting, as a completion ("41 42 43" -> " 44 45 46");
- counting asked by chat in instant mode (the template's `<think></think>` already closed);
- the reasoning probe in thinking mode: a thought, `</think>`, then the number;
- the tool probe: a short thought and one `get_weather` call in Kimi's tool-call section, which vLLM's `kimi_k2` tool parser turns into `tool_calls`.
Training takes about a minute on two cores.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from flows.demo.checkpoint import COUNT_LEN, NUMBERS, PROBES_FILE, TINY_CONFIG, build_int4, counting, counting_probes
from flows.demo.kimi import (KIMI_IGNORE, REASONING, RANKS, SPECIALS, TOOL_THOUGHT, kimi_config, load_tokenizer,
                             special_id, vision_weights, write_tokenizer)

STEPS, LEARNING_RATE = 400, 3e-3
COMPLETIONS, CHATS = 24, 8  # a step's counting texts: Kimi's tokenizer splits " 44" in two, so counting is learned slower
TOOL_CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
             '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')


def training_batches(tokenizer, rng: random.Random) -> list[list[str]]:
    """One step's texts in three batches of like lengths (padding one to the tool probe's ~120 tokens
    tripled the time): counting completions, counting chats in instant mode, and the reasoning probe
    with the tool probe (in thinking mode, as the check asks it: trained in instant mode too, the prompt's
    own `<think></think>` taught it to close its thought at once), each as the server will render it."""
    from tasks.answers.check import REASONING_PROBE, TOOL_PROMPT, WEATHER_TOOL

    def chat(content: str, **kwargs) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True, **kwargs)

    # Counting starts anywhere up to 93, as the probes do, and stops at 99.
    completions = [" ".join(NUMBERS[a:a + COUNT_LEN]) for a in (rng.randrange(94) for _ in range(COMPLETIONS))]
    chats = [chat(counting(a, 3), thinking=False) + counting(a + 3, 3) + "<|im_end|>"
             for a in (rng.randrange(94) for _ in range(CHATS))]
    probes = [chat(REASONING_PROBE.prompt, thinking=True) + f"{REASONING}</think>{REASONING_PROBE.expected}<|im_end|>",
              chat(TOOL_PROMPT, tools=[WEATHER_TOOL]) + f"{TOOL_THOUGHT}</think>{TOOL_CALL}<|im_end|>"]
    return [completions, chats, probes]


def _train(model, tokenizer, seed: int) -> None:
    import torch

    rng = random.Random(seed)
    pad = special_id("[PAD]")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LEARNING_RATE, total_steps=STEPS, pct_start=0.1)

    def loss_of(texts: list[str]):
        ids = [tokenizer.encode(text) for text in texts]
        width = max(map(len, ids))
        inputs = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
        labels = torch.tensor([i + [-100] * (width - len(i)) for i in ids])
        return model(input_ids=inputs, labels=labels).loss

    for _ in range(STEPS):
        loss = sum(loss_of(texts) for texts in training_batches(tokenizer, rng))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()


def build_kimi_bf16(out_dir: Path, seed: int = 0) -> Path:
    """The tiny Kimi-K2.5 in bf16, trained, its tokenizer, template and probes; returns the directory."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    write_tokenizer(out_dir)
    tokenizer = load_tokenizer(out_dir)
    torch.manual_seed(seed)
    text = {**TINY_CONFIG, "vocab_size": RANKS + SPECIALS}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**text, bos_token_id=special_id("[BOS]"),
                                                   eos_token_id=special_id("[EOS]"), tie_word_embeddings=False))
    _train(model, tokenizer, seed)
    with tempfile.TemporaryDirectory() as staging:
        # save_pretrained writes the experts one by one, as checkpoints name them (transformers fuses them in memory).
        model.to(torch.bfloat16).save_pretrained(staging)
        tensors = {f"language_model.{name}": t for name, t in load_file(Path(staging) / "model.safetensors").items()}
        text_config = json.loads((Path(staging) / "config.json").read_text())
    for key in ("transformers_version", "dtype", "_name_or_path"):
        text_config.pop(key, None)
    tensors |= vision_weights(TINY_CONFIG["hidden_size"], seed)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(kimi_config(text_config), indent=2))
    (out_dir / PROBES_FILE).write_text("".join(json.dumps(p) + "\n" for p in counting_probes()))
    return out_dir


def build_kimi_int4(bf16_dir: Path, out_dir: Path) -> Path:
    """The routed experts in INT4, the block inside text_config with Kimi-K2.5's ignore list."""
    return build_int4(bf16_dir, out_dir, ignore=KIMI_IGNORE)

