"""When Dynamo stops compiling a frame of ours: counted, warned about once, explained.

Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8) compiled entries per
code object. At the next guard failure it logs one warning and marks the code
``RUN_ONLY``: calls that match one of its cached entries still run our graphs, every
other call runs eager, silently and for the rest of the process. The backend is not
called again for that code, and the eager calls never reach our runner, so without this
module ``stats()`` shows nothing at all. The usual way there is ``model.generate()``
with a ``DynamicCache``: the cache's shapes and strides change after a compiled prefill,
and left padding changes the keyword arguments, each a new guard.

What is counted: ``stats().fallbacks["recompile_limit"]`` (or
``["accumulated_recompile_limit"]``), one per code object Dynamo gives up on, for codes
this backend compiled. What is not: the uncompiled calls that follow. Counting those
would mean wrapping the user's callable; compare ``sum(stats().calls.values())`` with
your own count of forward calls instead.
"""
from __future__ import annotations

import logging
import threading
import warnings

from .._torch import dynamo
from ..stats import COUNTERS

log = logging.getLogger(__name__)

ADVICE = (
    "For model.generate() use a static KV cache (generate(..., cache_implementation="
    "\"static\") or a transformers StaticCache), whose shapes and strides never change; or "
    "raise the limit (torch.compile(..., recompile_limit=N) or "
    "torch._dynamo.config.recompile_limit); or mark the batch dim unbacked "
    "(torch._dynamo.decorators.mark_unbacked(x, 0)) so one graph serves every batch size"
)


class RecompileLimitWatch:
    """Remembers which frames this backend compiled and reacts when Dynamo reports that
    it hit a recompile limit on one of them. One per process (:data:`WATCH`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frames: set[str] = set()
        self._warned = False

    def note_compiling_frame(self) -> None:
        """Called by the backend on every graph: install the log filter (once) and
        remember the frame Dynamo is compiling now.

        Installed on the backend's first call rather than on import: importing the
        package (its entry point is loaded by every ``torch.compile``) must not touch
        Dynamo's loggers, and no limit can be hit on a frame before it was compiled."""
        dynamo.on_recompile_limit(self.on_hit)
        label = dynamo.traced_frame_label()
        if label is not None:
            with self._lock:
                self._frames.add(label)

    def on_hit(self, hit: dynamo.RecompileLimitHit) -> None:
        with self._lock:
            # A frame only other backends compiled is theirs to report; a warning whose
            # function we could not read is counted: better visible twice than never.
            if hit.function is not None and hit.function not in self._frames:
                return
            first, self._warned = not self._warned, True
        COUNTERS.add_keyed("fallbacks", hit.limit)
        if not first:
            log.info("sizebackend: Dynamo hit config.%s for %s too", hit.limit, hit.function)
            return
        message = (
            f"sizebackend: Dynamo hit config.{hit.limit} ({hit.value}) for "
            f"{hit.function or 'a compiled frame'} and stopped compiling it: from now on "
            f"its calls that match none of its compiled graphs run uncompiled (eager) and "
            f"are not in stats().calls; counted in stats().fallbacks[{hit.limit!r}]. "
            f"{ADVICE}."
        )
        # Both channels, like cudagraphs.py. No stacklevel points at user code: this runs
        # inside Dynamo's frame conversion, at a depth that depends on the torch version.
        log.warning("%s", message)
        warnings.warn(message, RecompileLimitWarning)

    def reset(self) -> None:
        """``torch._dynamo.reset()`` dropped every frame's cache: forget the frames and
        warn again at the next hit."""
        with self._lock:
            self._frames.clear()
            self._warned = False


class RecompileLimitWarning(UserWarning):
    """Dynamo stopped compiling a frame this backend compiled (see the module doc)."""


WATCH = RecompileLimitWatch()
