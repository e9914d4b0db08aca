"""The checks that bytes from outside pass before the product uses them (docs/security.md).

A hub's answers, its file bodies and a model repo's files are hostile until checked: a commit sha
becomes a directory name, a file's hash a blob name, a file name a path under the snapshot, and a
body's length what lands on disk. Each check here is one line naming the input, and each read has
a stated bound, so that a hub that lies costs a refusal, never a file outside the models root or a
read that grows until memory or the disk runs out.
"""

from __future__ import annotations

import ipaddress
import os
import re
import time
import unicodedata
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from tasks.errors import HubError, UnusableInput

COMMIT = re.compile(r"[0-9a-f]{40}")  # git's sha1, as the Hub names a commit
SHA256 = re.compile(r"[0-9a-f]{64}")  # an LFS file's content hash, its blob's name in the HF cache
# A file name's part and the whole: Linux refuses a part over 255 bytes (ENAMETOOLONG), and the
# snapshot path adds the models root, the repo folder and the commit to the whole.
MAX_NAME_PART_BYTES = 255
MAX_NAME_BYTES = 1024
MAX_FILE_BYTES = 1 << 40  # 1 TiB: no model file comes near; a size beyond it is a lie that plans the disk wrong
MAX_REPO_FILES = 100_000  # the Hub advises at most this many files a repo; Kimi-K2.5 has ~80


def check_commit(sha: object, *, where: str) -> str:
    """A commit is 40 lowercase hex characters: it names the snapshot folder, so anything else (a
    path, `..`, an empty string) is refused before a directory is made from it."""
    if not isinstance(sha, str) or not COMMIT.fullmatch(sha):
        raise HubError(f"{where} answered commit sha {shown(sha)}: not 40 lowercase hex characters; refused")
    return sha


def check_filename(path: object) -> str:
    """Reject names that would write outside the snapshot directory, or that no filesystem takes:
    absolute, `..`, backslashes, `~`, control characters (NUL included), parts over 255 bytes."""
    if not isinstance(path, str):
        raise HubError(f"hub file name {shown(path)} is not a string")
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path or path.startswith("~"):
        raise HubError(f"hub file name {shown(path)} is unsafe: it would land outside the model directory")
    if any(unicodedata.category(c) == "Cc" for c in path):
        raise HubError(f"hub file name {shown(path)} is unsafe: it holds control characters")
    if len(path.encode()) > MAX_NAME_BYTES or any(len(p.encode()) > MAX_NAME_PART_BYTES for p in pure.parts):
        raise HubError(f"hub file name {shown(path)} is unsafe: longer than {MAX_NAME_PART_BYTES} bytes a part or "
                       f"{MAX_NAME_BYTES} in all")
    return path


def check_size(size: object, *, where: str) -> int:
    if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
        raise HubError(f"{where}: size {shown(size)} is not a number of bytes between 0 and {MAX_FILE_BYTES:,}")
    return size


def check_hash(value: object, pattern: re.Pattern, *, where: str) -> str | None:
    """A file's hash names its blob in the cache: lowercase hex of the right length, or absent."""
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise HubError(f"{where}: hash {shown(value)} is not {64 if pattern is SHA256 else 40} lowercase hex "
                       "characters; refused")
    return value


def check_tree(paths: list[str], *, where: str) -> None:
    """Names the cache can hold side by side: no name twice, no file that is another's folder."""
    if len(paths) > MAX_REPO_FILES:
        raise HubError(f"{where}: {len(paths):,} files listed, more than {MAX_REPO_FILES:,}")
    seen: set[str] = set()
    for p in paths:
        if p in seen:
            raise HubError(f"{where}: file {shown(p)} listed twice")
        seen.add(p)
    for p in paths:
        parent = PurePosixPath(p).parent
        while str(parent) != ".":
            if str(parent) in seen:
                raise HubError(f"{where}: {shown(str(parent))} is listed as a file and as the folder of {shown(p)}")
            parent = parent.parent


def inside(root: Path, path: Path, *, what: str) -> Path:
    """`path` once symlinks and `..` are resolved, refused unless it lies under `root` (resolved too):
    the last check before anything is created from names that came from outside."""
    base, resolved = root.resolve(), path.resolve()
    if resolved != base and base not in resolved.parents:
        raise HubError(f"{what} {path} resolves to {resolved}, outside {base}; refused")
    return resolved


class TooLarge(UnusableInput):
    """A body that went past the bound stated for it; the read stopped there."""

    stage = "the hub"


def read_bounded(chunks: Iterable[bytes], *, limit: int, what: str, deadline_s: float = 300.0) -> bytes:
    """The whole body, or TooLarge as soon as it passes `limit` bytes or takes longer than
    `deadline_s` (a body that drips a byte at a time stays under any per-read timeout): never more
    than limit + one chunk is held."""
    body = bytearray()
    ends = time.monotonic() + deadline_s
    for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"{what}: more than {limit:,} bytes; stopped reading there")
        if time.monotonic() > ends:
            raise TooLarge(f"{what}: still coming after {deadline_s:.0f} s ({len(body):,} bytes); stopped there")
    return bytes(body)


def read_file_bounded(path: Path, *, limit: int, what: str | None = None) -> bytes:
    """A local file's bytes, refused past `limit` without reading the rest (a FIFO or /dev/zero
    behind a name included)."""
    with path.open("rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{what or path}: more than {limit:,} bytes; not read")
    return data


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escaped(match: re.Match) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(value: object, limit: int = 80) -> str:
    """A value from outside as one printable line: repr'd, control characters escaped, cut short."""
    text = _CONTROL.sub(_escaped, repr(value))
    return text if len(text) <= limit else f"{text[:limit]}...({len(text):,} chars)"


def printable(text: str) -> str:
    """Text that names outside things (tensor names, ignore entries), on one line: control characters
    and newlines escaped, so a name cannot forge a line of the report or move the terminal."""
    return _CONTROL.sub(_escaped, text)


def loopback(host: str) -> bool:
    """Whether an address to listen on is reachable from this machine only ("" and 0.0.0.0 are
    every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def env_secret(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


MAX_STATE_BYTES = 16 * 1024 * 1024  # server.json, last-good.json, swap.json: kilobytes as written


def read_state_text(path: Path, limit: int = MAX_STATE_BYTES) -> str:
    """A host state file's text, read to a bound: FileNotFoundError where it is absent, ValueError
    (what its readers already take as "damaged") where it is larger than any record written or not
    UTF-8."""
    with path.open("rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: more than {limit:,} bytes, larger than any record this host writes")
    return data.decode()  # UnicodeDecodeError is a ValueError
