"""What this process's hardware offers, asked in one place.

It imports nothing of the package, so any module may read it without an import cycle
(:mod:`.options` checks ``cudagraphs=True`` against it). CPU tests monkeypatch
:func:`cuda_available` to run the CUDA-graph path on a simulator.
"""
from __future__ import annotations

import torch


def cuda_available() -> bool:
    """Whether a CUDA device is there, so that CUDA graphs can be captured."""
    return torch.cuda.is_available()
