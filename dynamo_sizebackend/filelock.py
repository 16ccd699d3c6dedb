"""An exclusive lock between processes on one machine: ``flock`` on an open file, which
the OS releases when its holder exits, however it exits. Imports nothing of the package
(the cache's compile locks and ``_torch/packed_linear.py``'s measurements use it)."""
from __future__ import annotations

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
