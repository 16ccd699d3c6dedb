"""Python's private ``threading._register_atexit`` (the hook ``concurrent.futures`` uses)."""
from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours)
import threading
from typing import Callable


def register_exit_hook(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit *before* daemon threads are stopped and before
    ``concurrent.futures`` shuts its pools down (hooks run last registered first, and
    this module imports ``concurrent.futures.thread`` so its hook is registered earlier).
    Falls back to :func:`atexit.register` where Python lacks the private hook."""
    getattr(threading, "_register_atexit", atexit.register)(fn)
