"""What the profiler ranges cost when no profiler runs (issue 22): the runner reads one
flag per graph call (``_torch/observe.py``), so the cost per piece is that read divided
by the pieces a call runs. Measured two ways in one run:

- the flag read itself (``timeit`` of ``observe.profiling()``);
- whole calls of a compiled 4-layer SDPA transformer (9 pieces: 5 compiled, 4
  attention), interleaved, with the read in place and with it replaced by a constant
  (the difference is the cost; noise on this machine is larger than the read, so
  treat a negative difference as zero).

And, for scale, the same call while ``torch.profiler`` records (ranges on).

    python benchmarks/bench_observe.py [--iters 3000]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import timeit

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-observe-"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_latency import interleaved  # noqa: E402
from dynamo_sizebackend._torch import observe  # noqa: E402
from dynamo_sizebackend.models.sdpa import TinyTransformer  # noqa: E402
from dynamo_sizebackend.runtime import runner as runner_module  # noqa: E402


class _NoCheck:
    """``observe`` as the runner sees it, minus the flag read."""

    def __getattr__(self, name):
        return getattr(observe, name)

    @staticmethod
    def profiling() -> bool:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=3000)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = TinyTransformer(layers=4, dim=64, heads=4).eval()
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": [2], "cache_dir": None})
    x = torch.randn(2, 4, 64)
    pieces = 9
    with torch.no_grad():
        compiled(x)
        read_ns = min(timeit.repeat(observe.profiling, number=100_000, repeat=5)) / 100_000 * 1e9

        def with_check():
            runner_module.observe = observe
            return compiled(x)

        def without_check():
            runner_module.observe = _NoCheck()
            return compiled(x)

        times = interleaved({"flag read": with_check, "no read": without_check}, a.iters)
        runner_module.observe = observe
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            profiled = interleaved({"profiler on": lambda: compiled(x)}, max(100, a.iters // 10))
    diff_ns = (times["flag read"] - times["no read"]) * 1e9
    print(f"flag read: {read_ns:.0f} ns per graph call = {read_ns / pieces:.1f} ns per piece "
          f"({pieces} pieces)")
    print(f"whole call, median of {a.iters} interleaved: with the read "
          f"{times['flag read'] * 1e6:.1f} us, without {times['no read'] * 1e6:.1f} us, "
          f"difference {diff_ns:.0f} ns ({max(diff_ns, 0) / pieces:.1f} ns per piece; target < 1000)")
    print(f"while torch.profiler records: {profiled['profiler on'] * 1e6:.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
