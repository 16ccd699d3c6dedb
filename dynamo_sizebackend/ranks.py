"""What every rank of a tensor-parallel model compiled and ran, side by side.

Ranks of one model agree by construction: they trace the same code, get the same
options, and the runner picks a call's program from its batch size alone, so every
rank runs the same size for the same call. They can still differ where a fallback
happened on one rank only (a size that failed to compile, a lazy or background size
not ready yet): that rank runs the general pieces, which hold the same collectives in
the same order, so the results stay right, only slower; :func:`compare_ranks` makes it
visible. What does *not* stay right is a rank that stops: with ``strict=True`` a failed
compile raises on that rank, and its peers fail in their next collective (at once when
the failed process exits and closes its connections, else after the process group's
timeout); nothing continues on a subset of the ranks.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from .stats import stats

#: The fields compared: what each rank ran and what fell back. Compiles are not: a rank
#: that loaded a piece another rank stored in a shared ``cache_dir`` compiled less.
COMPARED = ("graphs", "pieces", "splits", "calls", "fallbacks")


@dataclasses.dataclass(frozen=True)
class RankReport:
    ranks: list[dict[str, Any]]
    """Per rank of the group (by group rank): its ``stats().to_dict()``."""
    differences: list[str]
    """One line per compared field whose value differs between ranks, naming the
    values of each rank; empty when the ranks agree."""

    @property
    def agree(self) -> bool:
        return not self.differences


def compare_ranks(group: dist.ProcessGroup | None = None,
                  snapshot: dict[str, Any] | None = None) -> RankReport:
    """Gather every rank's ``sb.stats().to_dict()`` (or ``snapshot``, a dict with the
    same fields) and list where they differ (:data:`COMPARED`).

    A collective: every rank of ``group`` (default: the default group) must call it at
    the same point, e.g. after a warm-up or at the end of a benchmark."""
    mine = stats().to_dict() if snapshot is None else snapshot
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    differences = []
    for name in COMPARED:
        values = [rank[name] for rank in gathered]
        if isinstance(values[0], dict):
            for key in sorted({k for v in values for k in v}, key=str):
                per_rank = [v.get(key, 0) for v in values]
                if len(set(per_rank)) > 1:
                    differences.append(f"{name}[{key!r}]: " + _by_rank(per_rank))
        elif len(set(values)) > 1:
            differences.append(f"{name}: " + _by_rank(values))
    return RankReport(gathered, differences)


def _by_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
