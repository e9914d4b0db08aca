"""A host's cache mirror that logs what it served and flips a byte on request, as a bad disk or NIC
would: the fleet must end with a verified file anyway."""

from __future__ import annotations

import threading

from tasks.mirror import CacheMirror, MirrorHandler


class FaultyMirror(CacheMirror):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.served: list[str] = []  # the file of every GET it answered with bytes
        self._corrupt: set[str] = set()
        self._lock = threading.Lock()

    @property
    def handler(self) -> type[MirrorHandler]:
        return FaultyMirrorHandler

    def corrupt_once(self, rel: str) -> None:
        """The next GET of file `rel` gets one flipped byte."""
        with self._lock:
            self._corrupt.add(rel)


class FaultyMirrorHandler(MirrorHandler):
    owner: FaultyMirror

    def send_body(self, fh, rel: str, start: int, end: int) -> None:
        mirror = self.owner
        with mirror._lock:
            mirror.served.append(rel)
            flip = rel in mirror._corrupt
            mirror._corrupt.discard(rel)
        if not flip:
            return super().send_body(fh, rel, start, end=end)
        data = bytearray(fh.read(end + 1 - start))
        data[len(data) // 2] ^= 0xFF
        self.wfile.write(bytes(data))
