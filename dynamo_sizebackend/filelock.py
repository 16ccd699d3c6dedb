"""Files that processes on one machine share: an exclusive lock (``flock`` on an open
file, which the OS releases when its holder exits, however it exits) and a write that
readers see whole or not at all. Imports nothing of the package (the cache's compile
locks, ``_torch/packed_linear.py``'s measurements and ``_torch/isa_probe.py``'s marks
use it)."""
from __future__ import annotations

import os
import tempfile
import time


def lock_within(fd: int, wait: float) -> bool:
    """Take an exclusive lock on ``fd`` within ``wait`` seconds; whether it was taken."""
    import fcntl

    deadline = time.monotonic() + wait
    delay = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.25)


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder (made if
    missing) and a rename: a reader never sees a partial file. Raises ``OSError``."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
