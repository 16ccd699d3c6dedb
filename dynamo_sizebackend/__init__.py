"""dynamo_sizebackend: a torch.compile backend that compiles per batch size.

``torch.compile(model, backend="sizebackend", options={"compile_sizes": [1, 2, 4, 8]})``
splits the Dynamo graph at attention ops, compiles every piece once for the general
(symbolic) batch size and once per listed size, and dispatches each call by its batch size.
"""
__version__ = "0.1.0"

from . import ops  # noqa: E402,F401  (registers the sizebackend:: op library)
from .cache.package_worker import wait_for_packages  # noqa: E402
from .compile.failures import SizeCompileError  # noqa: E402
from .compile.freeze import weights_updated  # noqa: E402
from .options import SizeBackendOptions, check_options, parse_options  # noqa: E402
from .ranks import compare_ranks  # noqa: E402
from .stats import expect, reset_stats, stats  # noqa: E402

__all__ = ["SizeBackendOptions", "SizeCompileError", "parse_options", "check_options", "stats", "reset_stats", "expect",
           "weights_updated", "wait_for_packages", "compare_ranks"]
