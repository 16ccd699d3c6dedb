"""What the frozen-weights check costs per call of a sized program (issue 21).

Before every call of a size compiled with constant weights, the runner checks each
frozen tensor: is the argument at its position the same object, with the same
storage, data pointer, offset and version (``csrc/frozen_guard.cpp``)? This script
compiles a model whose size-2 pieces freeze ``--tensors`` parameters (a chain of
scalings, so the compile is quick), captures the real call arguments, and times:

  check      ``Program.weights_changed(args)``, what the runner calls (the C++ guard)
  python     the same three reads written in Python, for comparison
  call       a whole size-2 call of the compiled model (check included)

    python benchmarks/bench_frozen_check.py [--tensors 300] [--iters 20000]

Target: the check at most 5 us per sized call for 300 frozen tensors.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-frozen-"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import dynamo_sizebackend as sb  # noqa: E402
from dynamo_sizebackend.runtime.runner import Program  # noqa: E402


class Scales(nn.Module):
    """``tensors`` parameters, each read once: every one is frozen into the sized piece."""

    def __init__(self, tensors: int, dim: int = 8):
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(1 + 1e-3 * torch.randn(dim)) for _ in range(tensors))

    def forward(self, x):
        for s in self.scales:
            x = x * s
        return x


def per_call_us(fn, iters: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5: the check does no I/O, the minimum is its cost
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def python_check(frozen, args):
    """The check as Python would do it (what the C++ guard replaces)."""
    seen = [(args[i], args[i]._version, args[i].data_ptr()) for i in frozen.positions]

    def check():
        for (tensor, version, ptr), i in zip(seen, frozen.positions):
            a = args[i]
            if a is not tensor or a._version != version or a.data_ptr() != ptr:
                return False
        return True

    return check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--iters", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = Scales(args.tensors).eval()
    compiled = torch.compile(model, backend="sizebackend", options={
        "compile_sizes": [2], "sized_inductor_options": {"freezing": True}, "cache_dir": None,
    })
    seen = {}
    real = Program.weights_changed

    def spy(self, call_args):
        if self.frozen is not None:
            seen["program"], seen["args"] = self, call_args
        return real(self, call_args)

    x = torch.randn(3, 8)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    with torch.no_grad():
        start = time.perf_counter()
        compiled(x)
        compile_s = time.perf_counter() - start
        Program.weights_changed = spy
        try:
            compiled(torch.randn(2, 8))
        finally:
            Program.weights_changed = real
        program, call_args = seen["program"], seen["args"]
        frozen = program.frozen
        assert len(frozen) == args.tensors, (len(frozen), args.tensors)
        assert not program.weights_changed(call_args)
        check_us = per_call_us(lambda: program.weights_changed(call_args), args.iters)
        python_us = per_call_us(python_check(frozen, call_args), args.iters)
        x2 = torch.randn(2, 8)
        call_us = per_call_us(lambda: compiled(x2), max(1, args.iters // 20))
        torch.testing.assert_close(compiled(x2), model(x2))
    stats = sb.stats()
    print(f"frozen tensors: {len(frozen)}   compiles: {stats.compiles}   compile + first call: {compile_s:.1f} s")
    print(f"check   {check_us:8.2f} us per sized call  ({check_us / len(frozen) * 1000:.1f} ns per tensor)")
    print(f"python  {python_us:8.2f} us per sized call  ({python_us / len(frozen) * 1000:.1f} ns per tensor)")
    print(f"call    {call_us:8.2f} us per size-2 call of the compiled model, check included")
    print(f"target: check <= 5 us for 300 tensors: {'met' if check_us <= 5 * len(frozen) / 300 else 'MISSED'}")


if __name__ == "__main__":
    main()
