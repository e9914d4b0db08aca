"""The new revision's files against the last good one's: what fails before the swap, what is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tasks.answers.files import compare_files, has_chat_template


def _revision(root: Path, name: str, *, embed_seed: int = 0, rows: int = 6) -> Path:
    """A minimal model folder: weights, a BPE tokenizer.json, configs and a chat template."""
    folder = root / name
    folder.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": torch.randn(rows, 4, generator=torch.Generator().manual_seed(embed_seed))},
              folder / "model.safetensors")
    vocab = {"<|bos|>": 0, "4": 1, "7": 2, "44": 3, "47": 4, "x": 5}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []},
                                                      "added_tokens": [{"id": 0, "content": "<|bos|>"}]}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|bos|>"}))
    (folder / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 10000.0},
                                                    "transformers_version": "5.19.0", "vocab_size": rows}))
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return folder


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.fixture
def good(tmp_path) -> Path:
    return _revision(tmp_path, "good")


def _compare(new: Path, good: Path, **options):
    return compare_files(new, good, last_good="org/model@abc", **options)


def test_a_republish_of_the_same_files_changes_nothing(good, tmp_path):
    same = shutil.copytree(good, tmp_path / "same")
    (same / "README.md").write_text("re-published\n")  # not a file the model reads
    comparison = _compare(same, good)
    assert comparison.changes == [] and comparison.same_weights and comparison.problems == []


def test_two_token_ids_swapped_under_the_same_weights_fail_and_are_named(good, tmp_path):
    swapped = shutil.copytree(good, tmp_path / "swapped")

    def swap(data):
        vocab = data["model"]["vocab"]
        vocab["44"], vocab["47"] = vocab["47"], vocab["44"]
    _edit_json(swapped / "tokenizer.json", swap)
    comparison = _compare(swapped, good)
    assert comparison.problems == ["tokenizer: the ids of 2 tokens changed: '44' 3 -> 4, '47' 4 -> 3 (under weights "
                                   "of the same shapes, a token now reads another token's embedding; a retrained "
                                   "tokenizer: allow_changed_files)"]
    # New values of the same shapes (a retrain) with the new tokenizer: still refused unless said so.
    retrained = _revision(tmp_path, "retrained", embed_seed=1)
    shutil.copy2(swapped / "tokenizer.json", retrained / "tokenizer.json")
    assert not _compare(retrained, good).same_weights and _compare(retrained, good).problems
    allowed = _compare(retrained, good, allow_changes=True)
    assert allowed.problems == [] and [c.file for c in allowed.changes] == ["tokenizer", "weights"]
    # A grown vocabulary beside a grown embedding: other shapes, so named, not failed.
    grown = _revision(tmp_path, "grown", rows=7)
    _edit_json(grown / "tokenizer.json", lambda d: d["model"]["vocab"].update({"y": 6}))
    assert [(c.file, c.fails) for c in _compare(grown, good).changes] == [
        ("tokenizer", False), ("config.json", False), ("weights", False)]


def test_a_config_change_fails_under_the_same_weight_files_and_is_named_beside_new_ones(good, tmp_path):
    rope = shutil.copytree(good, tmp_path / "rope")
    _edit_json(rope / "config.json", lambda c: c["rope_parameters"].update(rope_theta=1e7))
    assert _compare(rope, good).problems == [
        "config.json: rope_parameters.rope_theta 10000.0 -> 10000000.0 (the same weight files, computed "
        "differently; a corrected config: allow_changed_files)"]
    version_only = shutil.copytree(good, tmp_path / "version")
    _edit_json(version_only / "config.json", lambda c: c.update(transformers_version="5.20.0"))
    assert _compare(version_only, good).changes == []  # the file's writer, not the model
    new_weights = _revision(tmp_path, "new", embed_seed=2)
    _edit_json(new_weights / "config.json", lambda c: c["rope_parameters"].update(rope_theta=1e7))
    assert [(c.file, c.fails) for c in _compare(new_weights, good).changes] == [("config.json", False),
                                                                               ("weights", False)]


def test_template_special_tokens_and_generation_config_are_named_not_failed(good, tmp_path):
    new = shutil.copytree(good, tmp_path / "new")
    (new / "chat_template.jinja").write_text("{{ '20 21 22' }}")
    _edit_json(new / "tokenizer_config.json", lambda c: c.update(eos_token="x"))
    _edit_json(new / "generation_config.json", lambda c: c.update(temperature=1.0))
    comparison = _compare(new, good)
    assert comparison.problems == []
    assert [(c.file, c.change) for c in comparison.changes] == [
        ("chat template", "changed (53 -> 16 chars)"), ("special tokens", "eos_token <|bos|> -> x"),
        ("generation_config.json", "temperature 0.6 -> 1.0")]
    (new / "chat_template.jinja").unlink()
    assert not has_chat_template(new) and has_chat_template(good)


def test_weights_in_the_hub_cache_are_told_apart_by_their_blob_not_read(good, tmp_path):
    # The Hub cache's layout: a snapshot's file links to blobs/<sha256>; the blob's name is the identity.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name, commit in (("aaa", "one"), ("aaa", "two"), ("bbb", "three")):
        blob = blobs / name
        if not blob.exists():
            shutil.copy2(good / "model.safetensors", blob)  # the same bytes under two blob names: not read
        snapshot = shutil.copytree(good, tmp_path / commit)
        (snapshot / "model.safetensors").unlink()
        (snapshot / "model.safetensors").symlink_to(blob)
    assert _compare(tmp_path / "two", tmp_path / "one").same_weights
    assert not _compare(tmp_path / "three", tmp_path / "one").same_weights
