"""The new revision's files against the last good deployment's, before the old server stops.

Some damage never shows in a short greedy probe: two number tokens swapped in the tokenizer cost
2 of 32 counting probes (inside any flat accuracy drop), and `rope_theta` x1000 moved the demo
model's perplexity by nothing measurable. Both are plain to see in the files, for free and before
the swap: no server is stopped for a revision that fails here.

What fails, and why:
- **The vocabulary changed while the weights kept their shapes.** The embedding rows are the same
  in number, so a token now reads another token's row: the model is the same, its words are not. A
  retrained model with a new tokenizer is legitimate: `AnswerSpec.allow_changed_files` says so.
- **`config.json` changed under the very same weight files.** The numbers are the same; what the
  model computes from them (positions, scaling, routing) is not. A republish with a corrected
  config is the same kind of change, and the operator who means it says so the same way.
- **The Python files changed** (a tokenizer's `tokenization_kimi.py`, a processor): under
  `--trust-remote-code` they are code the server executes, so a commit that changes them is a new
  program, not new data, whatever its weights. Named by file; an update the operator means:
  `allow_changed_files`.
Everything else that changed (the chat template, special tokens, `generation_config.json`, a config
beside new weights) is named in the artifact; the chat probes and the drift checks judge it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from safetensors import safe_open

from tasks.errors import CheckpointError, UnusableInput
from tasks.trust import read_file_bounded

# Files that say which token is which id: any byte changed is a changed vocabulary.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "vocab.txt")
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens")
# config.json keys that describe the file, not the model's arithmetic.
COSMETIC_CONFIG_KEYS = {"_name_or_path", "transformers_version"}
SHOWN = 4  # changes named per file; the rest are counted


class FileChange(BaseModel):
    file: str
    change: str  # in words: "rope_theta 10000 -> 10000000"
    fails: bool = False
    why: str = ""  # for a failing change: what it does to the model


class FilesComparison(BaseModel):
    """What differs between the new revision's files and the last good deployment's."""

    last_good: str  # repo@commit
    same_weights: bool  # every weight file the very same blob
    same_shapes: bool  # every tensor the same name and shape
    changes: list[FileChange]

    @property
    def problems(self) -> list[str]:
        return [f"{c.file}: {c.change} ({c.why})" for c in self.changes if c.fails]


# A repo's JSON is compared whole, so read to a bound: Kimi's tokenizer_config.json is kilobytes,
# a large tokenizer.json tens of megabytes.
MAX_JSON_BYTES = 256 * 1024 * 1024


def _json(path: Path) -> dict[str, Any] | None:
    """The file's JSON object; None where it is absent; CheckpointError where it is larger than any
    such file, not JSON, or not an object (a list where a dict is read would crash the comparison)."""
    try:
        value = json.loads(read_file_bounded(path, limit=MAX_JSON_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnusableInput) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({str(exc).splitlines()[0][:200]})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return value


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, inner in value.items() for k, v in _flat(inner, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): value}


def _dict_changes(old: dict[str, Any] | None, new: dict[str, Any] | None, ignore: set[str] = frozenset()) -> list[str]:
    """'key old -> new' for each flattened key that differs; a file that appeared or went is one change."""
    if old is None or new is None:
        return [] if old is new else ["added" if old is None else "removed"]
    before, after = _flat(old), _flat(new)
    return [f"{key} {before.get(key, '(none)')} -> {after.get(key, '(none)')}"
            for key in sorted(before.keys() | after.keys())
            if key.split(".")[0] not in ignore and before.get(key, ...) != after.get(key, ...)]


def _named(changes: list[str]) -> str:
    shown = ", ".join(changes[:SHOWN])
    return shown + (f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else "")


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


HASHED_AT_MOST = 1 << 30  # a plain file larger than this is not read whole to learn whether it changed


def _blob(path: Path) -> str:
    """The file's identity: the Hub cache's blob name (the LFS sha256) where the file links to one,
    else its bytes' sha256 for a small plain copy; a large plain file is taken as changed."""
    if path.is_symlink():
        return Path(os.path.realpath(path)).name
    if path.stat().st_size > HASHED_AT_MOST:
        return f"unhashed {path}"
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the files' headers alone (the validation has vetted them)."""
    shapes = {}
    for file in _weight_files(model_dir):
        with safe_open(file, framework="numpy") as weights:
            shapes |= {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    return shapes


def _vocabulary(model_dir: Path) -> dict[str, int] | None:
    """token -> id from tokenizer.json (its model's vocab and its added tokens); None without one."""
    data = _json(model_dir / "tokenizer.json")
    if data is None:
        return None
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    if isinstance(vocab, list):  # a Unigram model lists [piece, score] in id order
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
    return vocab


def _vocabulary_change(old_dir: Path, new_dir: Path) -> str | None:
    changed = [name for name in VOCAB_FILES
               if (old_dir / name).is_file() != (new_dir / name).is_file()
               or ((old_dir / name).is_file() and _blob(old_dir / name) != _blob(new_dir / name))]
    if not changed:
        return None
    old, new = _vocabulary(old_dir), _vocabulary(new_dir)
    if old is None or new is None:
        return f"{', '.join(changed)} changed"
    moved = [f"{token!r} {old[token]} -> {new[token]}" for token in sorted(old.keys() & new.keys(), key=old.get)
             if old[token] != new[token]]
    gone, added = len(old.keys() - new.keys()), len(new.keys() - old.keys())
    parts = ([f"the ids of {len(moved)} tokens changed: {_named(moved)}"] if moved else []) \
        + ([f"{gone} tokens removed"] if gone else []) + ([f"{added} tokens added"] if added else [])
    return "; ".join(parts) or "the merges changed (the same tokens split differently)"


MAX_CODE_FILES = 256  # a model repo ships a handful; more are not compared one by one


def _code_files(model_dir: Path) -> dict[str, str]:
    """path -> identity of every Python file in the snapshot (what remote code could import)."""
    found = sorted(model_dir.rglob("*.py"))[:MAX_CODE_FILES]
    return {str(path.relative_to(model_dir)): _blob(path) for path in found if path.is_file()}


def _code_change(old_dir: Path, new_dir: Path) -> str | None:
    old, new = _code_files(old_dir), _code_files(new_dir)
    changed = [f"{name} {'added' if name not in old else 'removed' if name not in new else 'changed'}"
               for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]
    return _named(changed) if changed else None


def _chat_template(model_dir: Path) -> str | None:
    """The template vLLM serves: chat_template.jinja beside the tokenizer, else tokenizer_config.json's."""
    if (path := model_dir / "chat_template.jinja").is_file():
        return path.read_text()
    if (data := _json(model_dir / "chat_template.json")) and data.get("chat_template"):
        return str(data["chat_template"])
    template = (_json(model_dir / "tokenizer_config.json") or {}).get("chat_template")
    return None if template is None else json.dumps(template) if not isinstance(template, str) else template


def has_chat_template(model_dir: Path) -> bool:
    return _chat_template(model_dir) is not None


def _special_tokens(model_dir: Path) -> dict[str, Any]:
    config = _json(model_dir / "tokenizer_config.json") or {}
    special = {key: config.get(key) for key in SPECIAL_KEYS if key in config}
    special |= {key: value for key, value in (_json(model_dir / "special_tokens_map.json") or {}).items()}
    decoder = config.get("added_tokens_decoder") or {}
    special["special ids"] = sorted(int(i) for i, t in decoder.items() if isinstance(t, dict) and t.get("special"))
    return special


def compare_files(new_dir: Path, last_good_dir: Path, *, last_good: str,
                  allow_changes: bool = False, code_runs: bool = True) -> FilesComparison:
    """Every change between the two revisions' files that bears on what the model answers.
    `code_runs`: whether the server executes the repo's Python (tasks/profiles/remote_code.py); a
    changed file it never imports is named and not failed."""
    old_weights, new_weights = _weight_files(last_good_dir), _weight_files(new_dir)
    same_weights = ([p.name for p in old_weights] == [p.name for p in new_weights]
                    and all(_blob(a) == _blob(b) for a, b in zip(old_weights, new_weights)))
    same_shapes = same_weights or _shapes(last_good_dir) == _shapes(new_dir)
    changes = []
    if vocabulary := _vocabulary_change(last_good_dir, new_dir):
        fails = same_shapes and not allow_changes
        changes.append(FileChange(file="tokenizer", change=vocabulary, fails=fails,
                                  why="under weights of the same shapes, a token now reads another token's "
                                      "embedding; a retrained tokenizer: allow_changed_files"
                                  if fails else ""))
    if code := _code_change(last_good_dir, new_dir):
        fails = code_runs and not allow_changes
        changes.append(FileChange(file="remote code", change=code, fails=fails,
                                  why="Python that --trust-remote-code executes on this host; an update you "
                                      "read and mean: allow_changed_files" if fails else ""))
    if (old := _chat_template(last_good_dir)) != (new := _chat_template(new_dir)):
        what = "added" if old is None else "removed" if new is None else f"changed ({len(old)} -> {len(new)} chars)"
        changes.append(FileChange(file="chat template", change=what))
    if special := _dict_changes(_special_tokens(last_good_dir), _special_tokens(new_dir)):
        changes.append(FileChange(file="special tokens", change=_named(special)))
    if config := _dict_changes(_json(last_good_dir / "config.json"), _json(new_dir / "config.json"),
                               COSMETIC_CONFIG_KEYS):
        changes.append(FileChange(file="config.json", change=_named(config), fails=same_weights and not allow_changes,
                                  why="the same weight files, computed differently; a corrected config: "
                                      "allow_changed_files" if same_weights and not allow_changes else ""))
    if generation := _dict_changes(_json(last_good_dir / "generation_config.json"),
                                   _json(new_dir / "generation_config.json"), COSMETIC_CONFIG_KEYS):
        changes.append(FileChange(file="generation_config.json", change=_named(generation)))
    if not same_weights:
        changes.append(FileChange(file="weights", change="the same tensors and shapes, new values" if same_shapes
                                  else "tensor names or shapes changed"))
    return FilesComparison(last_good=last_good, same_weights=same_weights, same_shapes=same_shapes, changes=changes)
