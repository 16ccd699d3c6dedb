"""dynamo_sizebackend: a torch.compile backend that compiles per batch size.

``torch.compile(model, backend="sizebackend", options={"compile_sizes": [1, 2, 4, 8]})``
splits the Dynamo graph at attention ops, compiles every piece once for the general
(symbolic) batch size and once per listed size, and dispatches each call by its batch size.
"""
from . import ops  # noqa: F401  (registers the sizebackend:: op library)
from .options import SizeBackendOptions, parse_options
from .stats import expect, reset_stats, stats

__all__ = ["SizeBackendOptions", "parse_options", "stats", "reset_stats", "expect"]

__version__ = "0.1.0"
