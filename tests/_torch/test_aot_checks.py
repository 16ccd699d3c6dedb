"""_torch.aot_checks: the checks in a stored package's C++ kernels are ``TORCH_CHECK``
(as a JIT kernel's are), so gcc treats the failing branch as cold; a failing check in a
package still raises in Python, as eager does for the same bad input.

The compile test runs the sized options a user gets (freezing, max-autotune) with Inductor
and AOTInductor: an embedding (whose kernel checks every index) feeding a linear, sized at
4 rows, its frozen piece stored inline as a package and then served from it."""
from __future__ import annotations

import threading
import types
import zipfile

import pytest
import torch
import torch.nn as nn

import dynamo_sizebackend as sb
from dynamo_sizebackend._torch import aot_checks
from dynamo_sizebackend.cache import store
from dynamo_sizebackend.cache.store import DiskCache

from ..nets import compile_sb

pytestmark = pytest.mark.usefixtures("no_shared_pieces")


class Lookup(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, 64)

    def forward(self, ids):
        return torch.relu(self.proj(self.emb(ids)))


OPTIONS = {"compile_sizes": [4], "store_frozen": "inline"}


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n))


def _kernel_sources(cache_dir) -> list[str]:
    """The C++ kernel sources inside the stored package of the size-4 piece."""
    disk = DiskCache(str(cache_dir))
    (entry,) = [e for e in disk.entries()[0] if e.kind == "aot"]
    key = entry.path.rsplit("/", 1)[1].removesuffix(store.SUFFIX)
    path = cache_dir / "piece.pt2"
    path.write_bytes(disk.read(key))
    with zipfile.ZipFile(path) as archive:
        return [archive.read(n).decode() for n in archive.namelist() if n.endswith("kernel.cpp")]


@pytest.mark.inductor
@torch.no_grad()
def test_packaged_kernels_check_with_torch_check_and_still_raise(real_defaults, tmp_path):
    torch.manual_seed(0)
    model = Lookup().eval()
    cache = tmp_path / "cache"
    before = aot_checks.COUNTS["replaced"]
    compiled = compile_sb(model, cache_dir=str(cache), **OPTIONS)
    with sb.expect(compiles={"dynamic": 1, 4: 1}, cache_misses=2, fallbacks={}):
        cold = {n: compiled(_ids(n)) for n in (3, 4)}
    for n, out in cold.items():
        torch.testing.assert_close(out, model(_ids(n)), rtol=1e-4, atol=1e-4)
    assert aot_checks.COUNTS["replaced"] > before

    sources = _kernel_sources(cache)
    assert sources, "the package holds no kernel source"
    assert not [s for s in sources if "AOTI_TORCH_CHECK(" in s]
    # The embedding's index check, in the form a JIT kernel has it.
    assert any("TORCH_CHECK(" in s and "index out of bounds" in s for s in sources)

    # Served from the package: the same bits; a bad index raises, as eager's does.
    torch._dynamo.reset()
    store.forget_shared()
    served = compile_sb(model, cache_dir=str(cache), **OPTIONS)
    with sb.expect(compiles={}, cache_hits=2, fallbacks={}, calls={4: 1}):
        assert torch.equal(served(_ids(4)), cold[4])
    bad = _ids(4)
    bad[2] = 1000
    with pytest.raises(IndexError):
        model(bad)
    with pytest.raises(RuntimeError, match="index out of bounds"):
        served(bad)


def test_only_aot_kernels_inside_the_scope_change(monkeypatch):
    from torch._inductor.codegen.common import KernelArgs
    from torch._inductor.codegen.cpp import CppKernel
    from torch._inductor.virtualized import V

    def macro(aot_mode: bool) -> str:
        with V.set_graph_handler(types.SimpleNamespace(aot_mode=aot_mode)):
            return CppKernel(KernelArgs(), 1).assert_function

    assert (macro(True), macro(False)) == ("AOTI_TORCH_CHECK", "TORCH_CHECK")
    with aot_checks.torch_checks():
        assert (macro(True), macro(False)) == ("TORCH_CHECK", "TORCH_CHECK")
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(macro(True)))
        thread.start()
        thread.join()
        assert elsewhere == ["AOTI_TORCH_CHECK"]  # another thread: Inductor's choice
    assert macro(True) == "AOTI_TORCH_CHECK"

    monkeypatch.setenv("SIZEBACKEND_AOT_TORCH_CHECK", "0")
    with aot_checks.torch_checks():
        assert macro(True) == "AOTI_TORCH_CHECK"
