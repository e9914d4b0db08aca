"""Kimi's tiktoken tokenizer, as the tiny Kimi-K2.5 ships it: remote code that vLLM runs only
under --trust-remote-code, loaded through `auto_map` in tokenizer_config.json.

Written for this project from the behaviour that public copies of Moonshot's tokenization_kimi.py
share (docs/kimi-public/k2.5/tokenizer.md): the class name and vocabulary file name the auto_map and
vLLM look for, the split regex, 256 special tokens numbered after the BPE ranks (named from
`added_tokens_decoder`, else `<|reserved_token_N|>`), special-token text in the input encoded as the
special token, and an `apply_chat_template` whose `thinking` parameter reaches the chat template (so
that vLLM passes a request's `chat_template_kwargs.thinking` through). Kimi-K2.5 also renders tools
as TypeScript declarations (tool_declaration_ts.py); this copy leaves `tools_ts_str` unset, and
the template then declares the tools as JSON, its own fallback.
"""

from __future__ import annotations

import os
from pathlib import Path
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

DEFAULT_SPECIAL = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>",
                   "[EOT]", "<|im_system|>", "<|im_middle|>"]


def _content(token) -> str:
    """An added_tokens_decoder entry's text, whether transformers passed an AddedToken or a dict."""
    if isinstance(token, dict):
        return str(token["content"])
    return str(getattr(token, "content", token))


def _sorted(value):
    """Tools with their keys in one order, so that the same tools render as the same prompt."""
    if isinstance(value, dict):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted(item) for item in value]
    return value


class TikTokenTokenizer(PreTrainedTokenizer):
    """A byte-level BPE over tiktoken's rank file, with Kimi's split regex and special tokens."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 256
    pat_str = "|".join([
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        if not os.path.isfile(vocab_file):
            raise ValueError(f"tiktoken vocabulary not found: {vocab_file}")
        names = {int(i): _content(token) for i, token in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(base, base + self.num_reserved_special_tokens)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=self.pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in byte_encoder.items()}
        self.decoder = {i: "".join(byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.model.n_vocab)}
        self.encoder = {text: i for i, text in self.decoder.items()}
        self.unk_id = self.special_tokens.get(str(unk_token)) if unk_token else None
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens or DEFAULT_SPECIAL,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self.decoder[i] for i in self.model.encode(text, allowed_special="all")]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)

    def apply_chat_template(self, conversation, tools=None, tokenize: bool = False, add_generation_prompt: bool = True,
                            thinking: bool = True, **kwargs):
        """Kimi's override: `thinking` named here so that vLLM hands a request's switch to the template."""
        return super().apply_chat_template(conversation, tools=_sorted(tools) if tools else tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, thinking=thinking, **kwargs)
