"""The CPU tuning is dropped for a graph whose GEMM rows stay symbolic at a listed size
(``dynamic=True`` on ``[batch, seq, dim]`` inputs: ``batch x seq`` rows), where frozen
weights measured slower than none (compile/rows.py); marking the batch dim alone keeps
the rows static and the tuning on."""
import pytest
import torch
import torch.nn as nn

import dynamo_sizebackend as sb
from dynamo_sizebackend.compile.batch import find_batch
from dynamo_sizebackend._torch import packed_linear
from dynamo_sizebackend.compile.rows import frozen_pays, symbolic_rows

from ..nets import TinyTransformer, batch

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _rows_of(model, *args, **compile_kwargs):
    """symbolic_rows of the one graph Dynamo hands a backend for ``model(*args)``."""
    found = []

    def capture(gm, example_inputs):
        info = find_batch(gm, None)
        found.append(symbolic_rows(gm, info.symbol))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture, **compile_kwargs)(*args)
    assert len(found) == 1
    return found[0]


def test_dynamic_true_on_3d_inputs_leaves_every_linear_with_symbolic_rows():
    model = TinyTransformer(layers=1).eval()
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert linears >= 3
    assert len(_rows_of(model, batch(3), dynamic=True)) == linears


def test_batch_dim_alone_leaves_static_rows():
    model = TinyTransformer(layers=1).eval()
    x = batch(3)
    torch._dynamo.mark_dynamic(x, 0)
    assert _rows_of(model, x) == []


class _Scores(nn.Module):
    """An activation x activation product over a symbolic length (attention scores,
    nothing to freeze) and a linear whose rows are the batch alone."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(8, 8)

    def forward(self, q, k):
        scores = (q @ k.transpose(-1, -2)).softmax(-1)  # [B, S, S]
        return self.out(scores.sum(1))  # [B, 8]: rows = B


def test_activation_products_are_not_counted():
    q, k = torch.randn(3, 8, 8), torch.randn(3, 8, 8)
    assert _rows_of(_Scores().eval(), q, k, dynamic=True) == []


def _sized_code(tmp_path, key):
    return [p.read_text() for p in tmp_path.glob(f"*_{key}.code.py")]


@pytest.mark.inductor
@torch.no_grad()
def test_real_defaults_compile_symbolic_rows_untuned_and_batch_only_tuned(real_defaults, tmp_path,
                                                                        monkeypatch):
    # Where MKL's GEMM is measured no slower than oneDNN's (the CPU the rule was measured on).
    monkeypatch.setattr(packed_linear, "onednn_faster", lambda rows, k, n: False)
    model = TinyTransformer(layers=1).eval()
    options = {"compile_sizes": [4], "cache_dir": None}
    untuned = torch.compile(model, backend="sizebackend", dynamic=True,
                            options={**options, "debug_dir": str(tmp_path / "dyn")})
    # 1 attention -> 2 pieces, general and size 4; one graph -> counted once.
    with sb.expect(compiles={"dynamic": 2, 4: 2}, fallbacks={"sized_untuned_symbolic_rows": 1}):
        for n in (4, 3):
            torch.testing.assert_close(untuned(batch(n)), model(batch(n)), **TOL)
    sized = _sized_code(tmp_path / "dyn", 4)
    assert len(sized) == 2 and not any("_frozen_param" in code for code in sized)

    torch._dynamo.reset()
    sb.reset_stats()
    tuned = torch.compile(model, backend="sizebackend",
                          options={**options, "debug_dir": str(tmp_path / "marked")})
    first = batch(3)
    torch._dynamo.mark_dynamic(first, 0)
    with sb.expect(compiles={"dynamic": 2, 4: 2}):
        for x in (first, batch(4)):
            torch.testing.assert_close(tuned(x), model(x), **TOL)
    assert "sized_untuned_symbolic_rows" not in sb.stats().fallbacks
    sized = _sized_code(tmp_path / "marked", 4)
    assert len(sized) == 2 and all("_frozen_param" in code for code in sized)


@pytest.mark.inductor
@torch.no_grad()
def test_symbolic_rows_keep_the_tuning_where_onednn_is_measured_faster(real_defaults, tmp_path,
                                                                        monkeypatch):
    measured = []

    def faster(rows, k, n):
        measured.append((rows, k, n))
        return True

    monkeypatch.setattr(packed_linear, "onednn_faster", faster)
    model = TinyTransformer(layers=1).eval()
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": [4], "cache_dir": None,
                                      "debug_dir": str(tmp_path)})
    with sb.expect(compiles={"dynamic": 2, 4: 2}):
        for n in (4, 3):
            torch.testing.assert_close(compiled(batch(n)), model(batch(n)), **TOL)
    assert "sized_untuned_symbolic_rows" not in sb.stats().fallbacks
    sized = _sized_code(tmp_path, 4)
    assert len(sized) == 2 and all("_frozen_param" in code for code in sized)
    # Every linear measured at the rows Dynamo traced with (batch 4 x seq 8).
    assert measured and {rows for rows, _, _ in measured} == {4 * 8}


def test_frozen_pays_only_where_every_gemm_is_measured_faster(monkeypatch):
    model = TinyTransformer(layers=1).eval()
    answers = {}

    def capture(gm, example_inputs):  # asked while Dynamo compiles, as the backend does
        symbol = find_batch(gm, None).symbol

        def ask(name, onednn, env="measure"):
            monkeypatch.setattr(packed_linear, "onednn_faster", onednn)
            monkeypatch.setenv("SIZEBACKEND_PACKED_LINEAR", env)
            answers[name] = frozen_pays(gm, symbol)

        answers["gemms"] = len(symbolic_rows(gm, symbol))
        said = iter([True, False])
        ask("one says MKL", lambda rows, k, n: next(said, True))
        ask("all say oneDNN", lambda rows, k, n: True)
        ask("switched off", lambda rows, k, n: True, env="torch")
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=True)(batch(3))
    assert answers == {"gemms": answers["gemms"], "one says MKL": False, "all say oneDNN": True,
                       "switched off": False}
    assert answers["gemms"] >= 3
