"""A tiny Kimi-K2.5, faithful to the real repo in everything but size (issue 39).

What is Kimi's and not DeepSeek's, as the demo model does not show it (docs/kimi-public/README.md's
checklist, each item's source in docs/kimi-public/SOURCES.md):
- the config: `KimiK25ForConditionalGeneration`, `model_type: kimi_k25`, the DeepSeek-V3 text model in
  `text_config` (`model_type: kimi_k2`), a MoonViT vision tower in `vision_config` (the canonical keys vLLM
  reads and the hub's `vt_*` twins), the quantization block inside `text_config`;
- the weights under `language_model.`, `vision_tower.` and `mm_projector.`;
- the tokenizer: tiktoken's rank file (`tiktoken.model`), `tokenization_kimi.py` through an `auto_map`
  (remote code: vLLM needs --trust-remote-code), no tokenizer.json; 256 special tokens numbered after
  the ranks, at Kimi's offsets;
- the chat template that thinks by default (`thinking: false` for instant mode), and tool calls in
  Kimi's sections, which vLLM's `kimi_k2` parsers read back.

Sizes: 768 BPE ranks (the 256 bytes, the numbers, the words of the template and the probes) and 256
specials make a vocabulary of 1,024; the text model is the demo's (tasks.checkpoint rules hold for
both); the vision tower has one block 32 wide. The text model is trained as the demo's is, briefly,
to answer its probes: counting by completion and by chat in instant mode, the reasoning probe in
thinking mode, and the tool probe with a `kimi_k2` tool call. The vision tower is random: nothing
asks it about an image.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

from flows.demo.checkpoint import COUNT_LEN, NUMBERS, PROBES_FILE, TINY_CONFIG, counting, counting_probes

FILES = Path(__file__).parent / "kimi_files"  # tokenization_kimi.py and chat_template.jinja, shipped as they are
RANKS = 768
SPECIALS = 256  # TikTokenTokenizer.num_reserved_special_tokens
# Kimi's special tokens by offset after the ranks (163584 + offset in the real vocabulary).
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
# Text, not control: the parsers read them from the decoded output (the tool parser turns
# skip_special_tokens off), so they are "special": false, as in Kimi's tokenizer_config.json.
TEXT_SPECIALS = {"<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"}
SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
REASONING = "17 + 25: 17 + 20 = 37, and 37 + 5 = 42."
TOOL_THOUGHT = "The user asks for the weather in Paris: call get_weather."
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, patch_size=14,
              pos_emb=8, merge=2)
# Kimi-K2.5's own ignore list (its text_config.quantization_config): only the routed experts are INT4.
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def special_id(token: str) -> int:
    return RANKS + next(offset for offset, name in SPECIAL_OFFSETS.items() if name == token)


def _words() -> list[str]:
    """The pieces Kimi's split regex cuts the template's and the probes' words into."""
    import regex

    from tasks.answers.check import REASONING_PROBE, TOOL_PROMPT, WEATHER_TOOL

    texts = [SYSTEM_PROMPT, TOOL_PROMPT, REASONING_PROBE.prompt, REASONING, TOOL_THOUGHT, json.dumps(WEATHER_TOOL),
             "user assistant system tool_declare functions.get_weather Return of",
             # The roles also open a message, with no space before them.
             "user", "assistant", "system", "tool"]
    pattern = regex.compile(_pat_str(), regex.V1)  # V1: the pattern intersects sets (`&&`), as tiktoken reads it
    return sorted({piece for text in texts for piece in pattern.findall(text)
                   if len(piece.encode()) > 1 and not piece.strip().isdigit()})


def _pat_str() -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tokenization_kimi", FILES / "tokenization_kimi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TikTokenTokenizer.pat_str


def bpe_ranks() -> list[bytes]:
    """Byte-level BPE ranks: the 256 bytes, 10..99, every prefix of each word (a word merges whole:
    each adjacent pair inside it joins into a longer prefix), then three-digit numbers up to 768."""
    ranks: list[bytes] = [bytes([b]) for b in range(256)] + [n.encode() for n in NUMBERS[10:]]
    seen = set(ranks)
    for word in _words():
        raw = word.encode()
        for end in range(2, len(raw) + 1):
            if raw[:end] not in seen:
                seen.add(raw[:end])
                ranks.append(raw[:end])
    number = 100
    while len(ranks) < RANKS:
        if str(number).encode() not in seen:
            ranks.append(str(number).encode())
        number += 1
    if len(ranks) > RANKS:
        raise ValueError(f"{len(ranks)} BPE ranks, more than the {RANKS} the tiny Kimi's vocabulary holds")
    return ranks


def write_tokenizer(out_dir: Path) -> None:
    """tiktoken.model, tokenization_kimi.py, tokenizer_config.json (auto_map), the chat template."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tiktoken.model").write_bytes(b"".join(base64.b64encode(piece) + b" %d\n" % rank
                                                     for rank, piece in enumerate(bpe_ranks())))
    shutil.copy2(FILES / "tokenization_kimi.py", out_dir / "tokenization_kimi.py")
    shutil.copy2(FILES / "chat_template.jinja", out_dir / "chat_template.jinja")
    added = {str(RANKS + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": name not in TEXT_SPECIALS}
             for offset, name in sorted(SPECIAL_OFFSETS.items())}
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"max_length": TINY_CONFIG["max_position_embeddings"], "eos_token_id": special_id("<|im_end|>")}, indent=2))
    (out_dir / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
        "in_patch_limit": 1024, "patch_size": VISION["patch_size"], "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": VISION["merge"], "fixed_output_tokens": None,
        "patch_limit_on_one_side": 64, "in_patch_limit_each_frame": 1024, "in_patch_limit_video": None,
        "sample_fps": 2.0, "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff"}}, indent=2))


def load_tokenizer(model_dir: Path):
    """The repo's own tokenizer, through its auto_map: the code vLLM runs under --trust-remote-code."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)


def vision_config(text_hidden: int) -> dict:
    v = VISION
    canonical = dict(hidden_size=v["hidden_size"], num_hidden_layers=v["num_hidden_layers"],
                     num_attention_heads=v["num_attention_heads"], intermediate_size=v["intermediate_size"])
    return {**canonical, **{f"vt_{k}": value for k, value in canonical.items()},
            "init_pos_emb_height": v["pos_emb"], "init_pos_emb_width": v["pos_emb"], "init_pos_emb_time": 4,
            "merge_kernel_size": [v["merge"], v["merge"]], "merge_type": "sd2_tpool", "patch_size": v["patch_size"],
            "mm_hidden_size": v["hidden_size"], "mm_projector_type": "patchmerger", "pos_emb_type": "divided_fixed",
            "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "text_hidden_size": text_hidden,
            "video_attn_type": "spatial_temporal"}


def vision_weights(text_hidden: int, seed: int) -> dict:
    """MoonViT and its patch-merger projector, random, named as Kimi-K2.5's checkpoint names them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    h, m, p, e = VISION["hidden_size"], VISION["intermediate_size"], VISION["patch_size"], VISION["pos_emb"]
    merged = h * VISION["merge"] ** 2

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def norm(prefix, width):
        return {f"{prefix}.weight": torch.ones(width, dtype=torch.bfloat16),
                f"{prefix}.bias": torch.zeros(width, dtype=torch.bfloat16)}

    def linear(prefix, out, inp):
        return {f"{prefix}.weight": rand(out, inp), f"{prefix}.bias": torch.zeros(out, dtype=torch.bfloat16)}

    tensors = {"vision_tower.patch_embed.proj.weight": rand(h, 3, p, p),
               "vision_tower.patch_embed.proj.bias": torch.zeros(h, dtype=torch.bfloat16),
               "vision_tower.patch_embed.pos_emb.weight": rand(e, e, h),
               **norm("vision_tower.encoder.final_layernorm", h), **norm("mm_projector.pre_norm", h),
               **linear("mm_projector.proj.0", merged, merged), **linear("mm_projector.proj.2", text_hidden, merged)}
    for block in range(VISION["num_hidden_layers"]):
        prefix = f"vision_tower.encoder.blocks.{block}"
        tensors |= {**norm(f"{prefix}.norm0", h), **norm(f"{prefix}.norm1", h), **linear(f"{prefix}.wqkv", 3 * h, h),
                    **linear(f"{prefix}.wo", h, h), **linear(f"{prefix}.mlp.fc0", m, h),
                    **linear(f"{prefix}.mlp.fc1", h, m)}
    return tensors


def kimi_config(text_config: dict) -> dict:
    """config.json as Kimi-K2.5 writes it (docs/kimi-public/k2.5/config.reconstructed.json), tiny."""
    ids = {"bos_token_id": special_id("[BOS]"), "eos_token_id": special_id("[EOS]"), "pad_token_id": special_id("[PAD]")}
    text = {**text_config, **ids, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModel": "modeling_deepseek.DeepseekV3Model",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
            "num_nextn_predict_layers": 0, "tie_word_embeddings": False}
    return {"architectures": ["KimiK25ForConditionalGeneration"],
            "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                         "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                         "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
            **ids, "ignore_index": -100, "media_placeholder_token_id": special_id("<|media_pad|>"),
            "image_token_id": special_id("<|media_pad|>"), "model_type": "kimi_k25", "text_config": text,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_unified_vision_chunk": True,
            "video_placeholder": "<|kimi_k25_video_placeholder|>", "vision_config": vision_config(text["hidden_size"])}
