"""What happens when a piece fails to compile: a counted, logged fallback, or an error
under ``strict=True``."""
from __future__ import annotations

import logging

from .._torch import dynamo, observe
from ..stats import COUNTERS

log = logging.getLogger(__name__)
_told: set[str] = set()  # decisions warned about in this process (tell_once)


def tell_once(key: str, logger: logging.Logger, message: str, *args: object) -> None:
    """A per-graph decision that costs speed: counted as ``fallbacks[key]``, logged as a
    warning the first time in the process and at INFO after (one warning per server,
    not one per graph)."""
    COUNTERS.add_keyed("fallbacks", key)
    logger.log(logging.INFO if key in _told else logging.WARNING, message, *args)
    _told.add(key)


class SizeCompileError(dynamo.user_error_base()):  # a RuntimeError
    """A piece failed to compile and ``strict=True`` asked for an error instead of a
    fallback. Reaches the caller as itself (not wrapped by Dynamo); ``__cause__`` is the
    compiler's own exception."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.first_useful_frame = None


class Fallbacks:
    """One graph's compile failures: each is counted in ``stats().fallbacks[size]`` and
    logged once per size, or raised as :class:`SizeCompileError` under ``strict``."""

    def __init__(self, graph_id: int, strict: bool):
        self.graph_id = graph_id
        self.strict = strict
        self._warned: set[str] = set()

    def record(self, key: str, what: str, error: Exception, uncompiled: bool = False) -> None:
        """``uncompiled``: the piece will run as is (a general or static compile failed);
        otherwise the size is served by the general pieces."""
        # Inductor's errors can carry a whole IR dump; the first line says what failed.
        lines = str(error).strip().splitlines() or [""]
        brief = lines[0][:300] + (" ..." if len(lines) > 1 or len(lines[0]) > 300 else "")
        if self.strict:
            raise SizeCompileError(
                f"sizebackend: graph {self.graph_id}: {what} failed to compile for size {key} "
                f"({type(error).__name__}: {brief}); strict=True turns this fallback into an error"
            ) from error
        COUNTERS.add_keyed("fallbacks", key)
        observe.artifact("sizebackend_fallback", lambda: {
            "graph": self.graph_id, "size": key, "what": what, "uncompiled": uncompiled,
            "error": f"{type(error).__name__}: {brief}"})
        if key not in self._warned:
            self._warned.add(key)
            log.warning(
                "sizebackend: graph %d: %s failed to compile for size %s (%s: %s); %s",
                self.graph_id, what, key, type(error).__name__, brief,
                "running it uncompiled" if uncompiled else "serving that size with the general pieces",
            )
