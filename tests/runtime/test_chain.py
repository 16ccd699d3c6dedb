"""A listed size whose pieces are all AOT packages runs as one C++ chain
(``runtime/chain.py``, ``csrc/chain.cpp``): no Python piece call, the same values as the
generated forward bit for bit, eager's logits and KV caches; a weight replaced after
compiling still recompiles the size (and the chain reads it as an input); a profiler, or
``direct_calls=False``, keeps the Python forward; a split op with a Python body runs in
the chain through the dispatcher.

Real defaults and Inductor (frozen, tuned pieces stored inline as packages): the path a
user serving from a warm cache gets.
"""
from __future__ import annotations

import gc
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn

import dynamo_sizebackend as sb
from dynamo_sizebackend import ops
from dynamo_sizebackend.runtime import runner
from dynamo_sizebackend.models import config

from ..models.test_llama import assert_caches_equal, fresh, run, serving_steps
from ..nets import compile_sb

pytestmark = pytest.mark.inductor


def _args(monkeypatch, compiled, step) -> tuple:
    """The arguments Dynamo hands the runner for one call."""
    seen = []
    call = runner.Runner.__call__

    def spy(self, *args):
        seen.append(args)
        return call(self, *args)

    with monkeypatch.context() as m:
        m.setattr(runner.Runner, "__call__", spy)
        compiled(*step)
    return seen[0]


@torch.no_grad()
def test_a_packaged_size_runs_as_one_chain(real_defaults, runners, monkeypatch, tmp_path):
    made, calls = runners
    steps = serving_steps(config("tiny").vocab_size)[:3]  # T = 8, 4, 3: size 4 listed
    model, expected_model = fresh(), fresh()
    compiled = compile_sb(model, compile_sizes=[4], cache_dir=str(tmp_path), store_frozen="inline")
    got = run(compiled, steps)
    for logits, expected in zip(got, run(expected_model, steps), strict=True):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert_caches_equal(model, expected_model, atol=1e-5, rtol=1e-5)
    stats = sb.stats()
    assert (stats.splits, stats.fallbacks, stats.calls) == (2, {}, {"dynamic": 2, "4": 1})
    (graph,) = made
    program = graph._by_size[4]
    assert program.chain is not None and len(program.chain) == 5  # 3 pieces, 2 attentions
    assert calls["pieces"] == 0  # the general pieces are JIT-compiled, not packages
    assert graph._general.chain is None

    # The same kernels in the same order as the generated forward: equal to the bit.
    args = _args(monkeypatch, compiled, steps[1])
    before = program.chain(args)
    torch.testing.assert_close(before, graph._forward(program, *args), rtol=0, atol=0)
    assert calls["pieces"] == 3

    # Under a profiler the pieces run from Python, each in its range.
    calls["pieces"] = 0
    with torch.profiler.profile() as prof:
        compiled(*steps[1])
    assert calls["pieces"] == 3
    assert any(e.key.endswith("/piece0/size4") for e in prof.key_averages())

    # A weight replaced after compiling: the size compiles again with it as an input,
    # still one chain, which now reads it from the call.
    new = torch.randn_like(model.layers[0].mlp.down_proj.weight)
    for m in (model, expected_model):
        m.layers[0].mlp.down_proj.weight = nn.Parameter(new.clone(), requires_grad=False)
    calls["pieces"] = 0
    torch.testing.assert_close(compiled(*steps[1]), expected_model(*steps[1]),
                               atol=1e-4, rtol=1e-4)
    assert sb.stats().fallbacks == {"frozen_weights": 1}
    assert graph._by_size[4] is not program and graph._by_size[4].chain is not None
    assert calls["pieces"] == 0

    # The retired program's packages free their constants when the last holder goes
    # (_torch/aoti.py): the chain holds them, so a chain outliving its program still
    # runs on the old weights; once it goes too, their memory is given back, all but
    # the constants the new program's packages share (every weight but the replaced one).
    old_chain = program.chain
    storages = [t.untyped_storage() for piece in program.pieces.values()
                if hasattr(piece, "package") for t in piece.package.constants.values()
                if t.layout == torch.strided]
    assert storages
    del program
    gc.collect()
    torch.testing.assert_close(old_chain(args), before, rtol=0, atol=0)
    assert all(s.nbytes() > 0 for s in storages)
    del old_chain
    gc.collect()
    live = {t.untyped_storage().data_ptr() for piece in graph._by_size[4].pieces.values()
            if hasattr(piece, "package") for t in piece.package.constants.values()
            if t.layout == torch.strided}
    freed = [s for s in storages if s.nbytes() == 0]
    assert freed and all(s.nbytes() == 0 or s.data_ptr() in live for s in storages)


@torch.no_grad()
def test_direct_calls_off_keeps_the_python_forward(real_defaults, runners, tmp_path):
    made, calls = runners
    steps = serving_steps(config("tiny").vocab_size)[1:2]  # T = 4
    model, expected_model = fresh(), fresh()
    compiled = compile_sb(model, compile_sizes=[4], cache_dir=str(tmp_path), store_frozen="inline",
                          direct_calls=False)
    torch.testing.assert_close(run(compiled, steps)[0], run(expected_model, steps)[0],
                               atol=1e-4, rtol=1e-4)
    (graph,) = made
    assert graph._by_size[4].chain is None
    assert calls["pieces"] == 3


torch.library.define("sizebackend_test::halve", "(Tensor x, float by) -> Tensor")


@torch.library.impl("sizebackend_test::halve", "CompositeExplicitAutograd")
def _halve(x, by):
    return x / by


class Halved(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.b(torch.ops.sizebackend_test.halve(torch.relu(self.a(x)), 2.0))


@torch.no_grad()
def test_a_named_python_op_runs_in_the_chain(real_defaults, runners, tmp_path):
    """A split op with a Python body: the chain calls it through the dispatcher, with
    its float constant converted by the schema; with ``pad_to_size`` a batch of 3 runs
    the size-4 chain on padded inputs."""
    made, calls = runners
    model = Halved().eval()
    compiled = compile_sb(model, compile_sizes=[4], cache_dir=str(tmp_path), store_frozen="inline",
                          splitting_ops=["sizebackend_test::halve"], pad_to_size=True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled(x * 3), model(x * 3), atol=1e-5, rtol=1e-5)
    out = compiled(x[:3])
    assert out.shape == (3, 32)
    torch.testing.assert_close(out, model(x[:3]), atol=1e-5, rtol=1e-5)
    (graph,) = made
    assert len(graph._by_size[4].chain) == 3 and calls["pieces"] == 0
    assert sb.stats().calls == {"4": 3}


def test_a_jit_piece_keeps_the_python_forward(runners, caplog):
    """The eager compiler's pieces are no packages: the size keeps the Python forward,
    and the DEBUG log says why."""
    from ..nets import MLP

    made, _ = runners
    caplog.set_level("DEBUG", logger="dynamo_sizebackend.runtime.chain")
    model = MLP()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    x = torch.randn(4, 16)
    torch.testing.assert_close(compiled(x), model(x))
    (graph,) = made
    assert graph._by_size[4].chain is None
    assert "size 4 runs its pieces from Python: a piece is not an AOT package" in caplog.text


@torch.no_grad()
def test_sdpa_as_dynamo_records_it_runs_in_the_chain(real_defaults, runners, monkeypatch, tmp_path):
    """``F.scaled_dot_product_attention`` reaches the split graph as the binding
    ``torch._C._nn.scaled_dot_product_attention``, which a CPU graph runs as
    ``sizebackend::sdpa`` (compile/cpu_sdpa.py): the chain calls that op, with the call's
    keyword (``is_causal``) and the schema's defaults; the same values as the Python
    forward, to the bit; other Python threads run meanwhile."""
    from dynamo_sizebackend.models.sdpa import TinyTransformer

    made, calls = runners
    model = TinyTransformer(1, 16, 4, mlp_ratio=4).eval()
    # The batch dim alone dynamic (the README's marking): every piece of size 2 static,
    # so each is a package.
    compiled = torch.compile(model, backend="sizebackend", options={
        "compile_sizes": [2], "cache_dir": str(tmp_path), "store_frozen": "inline"})
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    torch._dynamo.mark_dynamic(x, 0)
    torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    (graph,) = made
    program = graph._by_size[2]
    assert program.chain is not None and len(program.chain) == 3 and calls["pieces"] == 0
    y = x * 2
    torch._dynamo.mark_dynamic(y, 0)
    args = _args(monkeypatch, compiled, (y,))
    direct = ops.sdpa_counts()[0]
    torch.testing.assert_close(program.chain(args), graph._forward(program, *args),
                               rtol=0, atol=0)
    assert ops.sdpa_counts()[0] == direct + 2  # the chain's call and the forward's
    torch.testing.assert_close(program.chain(args)[0], model(y), atol=1e-5, rtol=1e-5)

    # The steps run without the GIL, as torch's runner runs one package: a thread that
    # waits for the GIL runs during the chain. (A switch interval of 60 s: no one
    # hands the GIL over unless a call releases it.) The chain is short (tens of us) and
    # the waiting thread must be woken by the OS before the chain takes the GIL back, a
    # race it can lose on a loaded machine (200 calls were not always enough under CI's
    # two workers): chain calls go on until it gets in, for up to 5 s; a chain that kept
    # the GIL would let it in in none of them.
    ran, go = [], threading.Event()
    thread = threading.Thread(target=lambda: (go.wait(), ran.append(1)))
    thread.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60)
    chains = 0
    try:
        go.set()
        deadline = time.perf_counter() + 0.05  # the thread wakes and waits for the GIL
        while time.perf_counter() < deadline:
            pass
        assert not ran
        give_up = time.perf_counter() + 5.0
        while not ran and time.perf_counter() < give_up:
            program.chain(args)
            chains += 1
        during = list(ran)
    finally:
        sys.setswitchinterval(interval)
        thread.join()
    assert during == [1], f"no other thread ran during {chains} chain calls"
