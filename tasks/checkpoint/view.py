"""A checkpoint's config, index and safetensors headers, from a local folder or from the Hub.

Validation reads a CheckpointView and never cares where it came from, so `rollout validate REPO_ID`
(before download, range requests only) and `rollout validate DIR` (after) give the same verdict.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import orjson

from tasks.checkpoint.headers import (
    FileHeader,
    TensorMeta,
    check_run_budget,
    local_header_length,
    read_int_values,
    read_local_header,
    read_remote_header,
    remote_header_length,
)
from tasks.errors import CheckpointError
from tasks.trust import TooLarge, read_bounded, read_file_bounded

if TYPE_CHECKING:  # huggingface_hub costs 0.2 s of import that `rollout validate DIR` does without
    from tasks.hub import RepoSnapshot

INDEX_FILE = "model.safetensors.index.json"
# JSON read whole, so read to a bound: a config.json is kilobytes; Kimi-K2.5's index is 20 MB.
MAX_JSON_BYTES = {"config.json": 16 * 1024 * 1024, INDEX_FILE: 256 * 1024 * 1024}
ValueReader = Callable[[list[TensorMeta]], dict[TensorMeta, tuple[int, ...]]]


@dataclass
class CheckpointView:
    source: str
    config: dict
    headers: list[FileHeader]
    weight_map: dict[str, str] | None
    stored_shards: set[str]  # every *.safetensors file the checkpoint has
    missing_shards: set[str]  # named by the weight map but absent
    total_bytes: int
    bytes_read: int
    read_values: ValueReader | None  # None where reading tensor values would cost a request each


def _json(data: bytes, where: str) -> dict:
    try:
        value = orjson.loads(data)  # a Kimi-sized index is 20 MB: 0.1 s with json, a third of that here
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    return value


def _weight_map(index: dict, where: str) -> dict[str, str]:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{where}: weight_map is missing or not a name -> file mapping")
    return weight_map


def _local_json(path: Path) -> bytes:
    try:
        return read_file_bounded(path, limit=MAX_JSON_BYTES[path.name])
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except TooLarge as exc:
        raise CheckpointError(str(exc)) from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from exc


def local_view(model_dir: Path) -> CheckpointView:
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    config_path = model_dir / "config.json"
    config_bytes = _local_json(config_path)
    config = _json(config_bytes, str(config_path))
    read = len(config_bytes)
    weight_map = None
    if (index_path := model_dir / INDEX_FILE).exists():
        index_bytes = _local_json(index_path)
        read += len(index_bytes)
        weight_map = _weight_map(_json(index_bytes, str(index_path)), str(index_path))
    stored = {p.name for p in model_dir.glob("*.safetensors")}
    named = set(weight_map.values()) if weight_map else set()
    if not stored:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    lengths = {name: local_header_length(model_dir / name) for name in sorted(stored)}
    check_run_budget(lengths, str(model_dir))
    headers = [read_local_header(model_dir / name, lengths[name]) for name in sorted(stored)]

    def read_values(metas: list[TensorMeta]) -> dict[TensorMeta, tuple[int, ...]]:
        by_file: dict[str, list[TensorMeta]] = defaultdict(list)
        for m in metas:
            by_file[m.file].append(m)
        return {k: v for f, ms in by_file.items() for k, v in read_int_values(model_dir / f, ms).items()}

    return CheckpointView(
        source=str(model_dir), config=config, headers=headers, weight_map=weight_map, stored_shards=stored,
        missing_shards=named - stored, total_bytes=sum(h.file_size for h in headers),
        bytes_read=read + sum(h.header_bytes for h in headers), read_values=read_values,
    )


def remote_view(snapshot: RepoSnapshot, endpoint: str | None = None) -> CheckpointView:
    """Config and index by GET, headers by range requests; no shard is downloaded."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from tasks.hub import reaching

    repo_id = snapshot.repo_id
    sizes = {f.path: f.size for f in snapshot.files}
    http_headers = build_hf_headers()  # the token comes from HF_TOKEN / the login, never an argument
    source = f"{repo_id}@{snapshot.commit[:12]}"

    def url(name: str) -> str:
        return hf_hub_url(repo_id, name, revision=snapshot.commit, endpoint=endpoint)

    def get(name: str) -> bytes:
        """The file whole, to the smaller of its published size and its JSON bound."""
        if name not in sizes:
            raise CheckpointError(f"{source}: {name}: missing")
        limit = MAX_JSON_BYTES[name]
        if sizes[name] > limit:
            raise CheckpointError(f"{source}: {name}: published as {sizes[name]:,} bytes, beyond the {limit:,} "
                                  "read for it")
        with get_session().stream("GET", url(name), headers=http_headers, follow_redirects=True,
                                  timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
            hf_raise_for_status(r)
            try:
                return read_bounded(r.iter_bytes(), limit=sizes[name],
                                    what=f"{source}: {name} (published as {sizes[name]:,} bytes)")
            except TooLarge as exc:
                raise CheckpointError(str(exc)) from exc

    with reaching(endpoint):
        config_bytes = get("config.json")
        config = _json(config_bytes, f"{source}: config.json")
        read = len(config_bytes)
        weight_map = None
        if INDEX_FILE in sizes:
            index_bytes = get(INDEX_FILE)
            read += len(index_bytes)
            weight_map = _weight_map(_json(index_bytes, f"{source}: {INDEX_FILE}"), f"{source}: {INDEX_FILE}")
        stored = {p for p in sizes if p.endswith(".safetensors") and "/" not in p}
        if not stored:
            raise CheckpointError(f"{source}: no *.safetensors files")
        with ThreadPoolExecutor(max_workers=16) as pool:
            names = sorted(stored)
            lengths = dict(zip(names, pool.map(
                lambda n: remote_header_length(url(n), n, sizes[n], headers=http_headers), names)))
            check_run_budget(lengths, source)
            headers = list(pool.map(
                lambda n: read_remote_header(url(n), n, sizes[n], headers=http_headers, length=lengths[n]), names))
    named = set(weight_map.values()) if weight_map else set()
    return CheckpointView(
        source=source, config=config, headers=headers, weight_map=weight_map, stored_shards=stored,
        missing_shards=named - stored, total_bytes=sum(h.file_size for h in headers),
        bytes_read=read + sum(h.header_bytes for h in headers), read_values=None,
    )
