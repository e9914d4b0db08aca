"""Hostile and broken safetensors headers: a one-line CheckpointError, never a crash or a big allocation."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest

from tasks.checkpoint.headers import MAX_HEADER_BYTES, read_local_header
from tasks.errors import CheckpointError


def write_raw(path: Path, header: dict | bytes, data_len: int, claimed_len: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", claimed_len if claimed_len is not None else len(raw)) + raw + bytes(data_len))
    return path


GOOD = {"a": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]},
        "b": {"dtype": "I32", "shape": [2], "data_offsets": [16, 24]}}


def test_good_header_reads_offsets_and_counts_bytes(tmp_path):
    header = read_local_header(write_raw(tmp_path / "m.safetensors", GOOD, 24))
    raw_len = len(json.dumps(GOOD).encode())
    assert header.header_bytes == 8 + raw_len
    assert header.tensors["b"].start == 8 + raw_len + 16 and header.tensors["b"].nbytes == 8


@pytest.mark.parametrize(
    "header, data_len, claimed, message",
    [
        (GOOD, 24, 10**12, "header claims 1000000000000 bytes"),
        (GOOD, 24, MAX_HEADER_BYTES + 1, "limit"),
        (b"{not json", 0, None, "header is not valid JSON"),
        (b"[1, 2]", 0, None, "not a JSON object"),
        ({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}, 2, None, "unknown dtype 'Q7'"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8000]}}, 8, None, "outside the 8-byte data section"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-4, 4]}}, 8, None, "outside"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16, None, "overlap"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, None, "8 bytes for F32[3]"),
        ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, 8, None, "not a list of sizes"),
        ({"a": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}, 8, None, "not a list of sizes"),
        ({"a": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, 8, None, "not a list of sizes"),
        ({"a": [1, 2]}, 0, None, "entry is not an object"),
    ],
)
def test_hostile_header_is_a_clear_error(tmp_path, header, data_len, claimed, message):
    path = write_raw(tmp_path / "bad.safetensors", header, data_len, claimed)
    with pytest.raises(CheckpointError, match="bad.safetensors") as info:
        read_local_header(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_huge_claimed_length_allocates_nothing(tmp_path):
    path = write_raw(tmp_path / "bad.safetensors", GOOD, 24, claimed_len=2**63)
    tracemalloc.start()
    with pytest.raises(CheckpointError):
        read_local_header(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1_000_000


def test_file_shorter_than_the_length_prefix(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        read_local_header(path)
