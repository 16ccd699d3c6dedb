"""Frozen pieces' packages run on 64-byte aligned constants (``_torch/aoti.py``): each
internal constant gets its own copy, also where Inductor gives several one FQN (the
case an earlier attempt got wrong); a package it cannot verify runs on torch's loader,
counted in ``fallbacks["aot_unaligned"]``.

Real Inductor and AOTInductor compiles with the sized options a user gets (freezing and
max-autotune: the C++ GEMM template packs each weight per GEMM), of a chain of three
linears: one piece, three GEMMs whose packed weights share one FQN (no two GEMMs share
an input, so the default's concatenation of such linears leaves all three); and with freezing alone,
whose weights oneDNN packs into opaque tensors.
"""
from __future__ import annotations

import dataclasses
import gc
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import dynamo_sizebackend as sb
from dynamo_sizebackend._torch import aoti
from dynamo_sizebackend.cache import store
from dynamo_sizebackend.cache.store import DiskCache

from ..nets import MLP, compile_sb

pytestmark = pytest.mark.usefixtures("no_shared_pieces")


class Chain(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.inner = nn.Linear(dim, hidden, bias=False)
        self.middle = nn.Linear(hidden, hidden, bias=False)
        self.outer = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.outer(F.silu(self.middle(F.silu(self.inner(x)))))


OPTIONS = {"compile_sizes": [4], "store_frozen": "inline"}
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _x(n: int) -> torch.Tensor:
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(n))


def _restart():
    torch._dynamo.reset()
    store.forget_shared()


def _serve(model, cache_dir) -> dict[int, torch.Tensor]:
    compiled = compile_sb(model, cache_dir=str(cache_dir), **OPTIONS)
    outs = {n: compiled(_x(n)) for n in (3, 4)}
    for n, out in outs.items():
        torch.testing.assert_close(out, model(_x(n)), **TOL)
    return outs


def _packages(cache_dir, tmp_path) -> dict[int, str]:
    """Every stored package of the cache, as ``.pt2`` files, by size."""
    disk = DiskCache(str(cache_dir))
    paths = {}
    for entry in disk.entries()[0]:
        if entry.kind == "aot":
            key = entry.path.rsplit("/", 1)[1].removesuffix(store.SUFFIX)
            path = tmp_path / f"{key}.pt2"
            path.write_bytes(disk.read(key))
            paths[int(entry.size)] = str(path)
    return paths


def _package(cache_dir, tmp_path) -> str:
    """The stored package of the size-4 piece, as a ``.pt2`` file."""
    (path,) = _packages(cache_dir, tmp_path).values()
    return path


def _table(path: str) -> list[aoti.Constant]:
    with zipfile.ZipFile(path) as archive:
        (wrapper,) = [n for n in archive.namelist() if n.endswith("wrapper.cpp")]
        return aoti.parse_constants(archive.read(wrapper).decode())


@pytest.mark.inductor
@torch.no_grad()
def test_packages_run_on_aligned_constants_each_its_own(real_defaults, tmp_path, monkeypatch):
    # The GEMM template's packed weights (panel_linear, where measured faster, would take
    # some of its GEMMs: its weights are plain constants of FQNs of their own).
    monkeypatch.setenv("SIZEBACKEND_PANEL_LINEAR", "0")
    torch.manual_seed(0)
    model = Chain().eval()
    cache = tmp_path / "cache"
    with sb.expect(compiles={"dynamic": 1, 4: 1}, cache_misses=2, fallbacks={}):
        cold = _serve(model, cache)

    # The package: several constants share one FQN, each of its own shape or values.
    path = _package(cache, tmp_path)
    table = _table(path)
    fqns = [c.fqn for c in table]
    assert len(set(fqns)) < len(fqns), [(c.name, c.fqn) for c in table]
    aligned = aoti.load_aligned(path)
    assert isinstance(aligned, aoti.AlignedCpuPackage), aligned
    assert {n: tuple(t.shape) for n, t in aligned.constants.items()} == {c.name: c.shape for c in table}
    assert all(aoti.address(t) % aoti.ALIGNMENT == 0 for t in aligned.constants.values())
    shared = [c.name for c in table if fqns.count(c.fqn) > 1]
    copies = [aligned.constants[n] for n in shared]
    assert all(not (a.shape == b.shape and torch.equal(a, b)) for i, a in enumerate(copies)
               for b in copies[i + 1:]), "two GEMMs were handed one packed weight"
    # The same outputs as torch's loader on the same package, bit for bit.
    loaded = torch._inductor.aoti_load_package(path)
    ours, theirs = aligned.run([_x(4)]), loaded.loader.run([_x(4)])
    assert len(ours) == len(theirs) >= 1 and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # Called as the exported module (outputs rebuilt from the call spec), as torch's.
    ours, theirs = aligned(_x(4)), loaded(_x(4))
    assert type(ours) is type(theirs)
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(ours), pytree.tree_leaves(theirs)))

    # A restart loads it aligned: nothing compiles, nothing falls back, the same bits.
    _restart()
    with sb.expect(compiles={}, cache_hits=2, fallbacks={}):
        warm = _serve(model, cache)
    assert all(torch.equal(warm[n], cold[n]) for n in (3, 4))

    # A table whose names are mixed up (two constants of one FQN trade names: the
    # mix-up an FQN-keyed copy makes) is refused: torch's loader serves, counted.
    parse = aoti.parse_constants

    def mixed_up(source):
        got = parse(source)
        i, j = [k for k, c in enumerate(got) if fqns.count(c.fqn) > 1][:2]
        got[i], got[j] = (dataclasses.replace(got[i], name=got[j].name),
                          dataclasses.replace(got[j], name=got[i].name))
        return got

    with monkeypatch.context() as patch:  # (undo() would also undo real_defaults)
        patch.setattr(aoti, "parse_constants", mixed_up)
        refusal = aoti.load_aligned(path)
        assert isinstance(refusal, aoti.NotAligned) and refusal.counted, refusal
        assert "not the aligned copy after the swap" in refusal.reason
        _restart()
        with sb.expect(compiles={}, cache_hits=2, fallbacks={"aot_unaligned": 1}):
            refused = _serve(model, cache)
    assert all(torch.equal(refused[n], cold[n]) for n in (3, 4))
    # Byte counts that do not add up to the library's constants: refused before the swap.
    with monkeypatch.context() as patch:
        patch.setattr(aoti, "parse_constants", lambda source: [
            dataclasses.replace(c, nbytes=c.nbytes + aoti.ALIGNMENT) for c in parse(source)])
        refusal = aoti.load_aligned(path)
        assert refusal.counted and "are not the library's" in refusal.reason, refusal

    # Turned off: torch's loader, not counted (nothing was asked).
    monkeypatch.setenv("SIZEBACKEND_ALIGN_PACKAGES", "0")
    assert aoti.load_aligned(path) == aoti.NotAligned("off (SIZEBACKEND_ALIGN_PACKAGES=0)")
    _restart()
    with sb.expect(compiles={}, cache_hits=2, fallbacks={}):
        off = _serve(model, cache)
    assert all(torch.equal(off[n], cold[n]) for n in (3, 4))


def test_the_constant_table_is_read_strictly():
    source = "\n".join([
        'constants_info_[0].name = "w";',
        "constants_info_[0].dtype = cached_torch_dtype_bfloat16;",
        "constants_info_[0].offset = 2;",
        "constants_info_[0].data_size = 16;",
        "constants_info_[0].from_folded = false;",
        "constants_info_[0].shape = {2, 3};",
        "constants_info_[0].stride = {3, 1};",
        "constants_info_[0].layout = static_cast<int32_t>(cached_torch_layout_strided);",
        'constants_info_[0].original_fqn = "m.w";',
    ])
    (c,) = aoti.parse_constants(source)
    assert (c.name, c.fqn, c.dtype, c.shape, c.stride, c.offset, c.nbytes, c.folded, c.strided) == (
        "w", "m.w", torch.bfloat16, (2, 3), (3, 1), 2, 16, False, True)
    assert c.fits()  # elements 2..7 of 8
    assert not dataclasses.replace(c, offset=3).fits()
    opaque = source.replace("cached_torch_layout_strided", "cached_torch_layout__mkldnn")
    assert not aoti.parse_constants(opaque)[0].strided
    with pytest.raises(ValueError, match="constant 0"):
        aoti.parse_constants(source.replace("data_size", "size"))
    with pytest.raises(ValueError, match="constant 1 missing"):
        aoti.parse_constants(source + "\n" + source.replace("[0]", "[2]"))
    with pytest.raises(ValueError, match="ELF64"):
        aoti.embedded_constants(b"not a library")


@pytest.mark.inductor
@torch.no_grad()
def test_onednn_packed_constants_get_aligned_clones(tmp_path, monkeypatch):
    # Freezing without max-autotune: mkldnn's linear, whose packed weights are opaque
    # (oneDNN) tensors in the same misaligned blob (not panel_linear's plain ones).
    monkeypatch.setenv("SIZEBACKEND_PANEL_LINEAR", "0")
    torch.manual_seed(0)
    model = MLP().eval()
    cache = tmp_path / "cache"
    compiled = compile_sb(model, cache_dir=str(cache), compile_sizes=[4], store_frozen="inline",
                          sized_inductor_options={"freezing": True})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(compiled(x), model(x), **TOL)
    path = _package(cache, tmp_path)
    opaque = [c.name for c in _table(path) if not c.strided]
    assert opaque
    aligned = aoti.load_aligned(path)
    assert isinstance(aligned, aoti.AlignedCpuPackage), aligned
    assert all(aligned.constants[n].is_mkldnn for n in opaque)
    assert all(aoti.address(t) % aoti.ALIGNMENT == 0 for t in aligned.constants.values())
    loaded = torch._inductor.aoti_load_package(path)
    ours, theirs = aligned.run([x]), loaded.loader.run([x])
    assert len(ours) == len(theirs) >= 1 and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _fake_package(path, device: str, *more: str) -> str:
    """A package's layout (library, source, metadata naming ``device``, ``more`` files)
    with nothing real inside: what is decided before anything loads."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("p/data/aotinductor/model/x.wrapper.so", b"\x7fELF")
        archive.writestr("p/data/aotinductor/model/x.wrapper.cpp", "")
        archive.writestr("p/data/aotinductor/model/x.wrapper_metadata.json",
                         f'{{"AOTI_DEVICE_KEY": "{device}"}}')
        for name in more:
            archive.writestr(f"p/data/aotinductor/model/{name}", "{}")
    return str(path)


def test_a_package_for_another_device_is_left_to_torch_uncounted(tmp_path):
    # The layout of a GPU package whose kernels are embedded in its library: only its
    # metadata says it is not for the CPU. Nothing is loaded or counted.
    path = _fake_package(tmp_path / "gpu.pt2", "cuda")
    assert aoti.load_aligned(path) == aoti.NotAligned("not one CPU library")
    assert aoti.load_aligned(str(tmp_path / "missing.pt2")).counted is False
    # A CPU package with a file only torch's loader knows how to set up (a TorchBind
    # object's): left to it, uncounted, before anything is loaded.
    path = _fake_package(tmp_path / "objs.pt2", "cpu", "custom_objs_config.json")
    assert aoti.load_aligned(path) == aoti.NotAligned(
        "holds custom_objs_config.json, which torch's loader sets up")



class Lookup(nn.Module):
    """An embedding table (a constant no GEMM packs: the same bytes at every size) and a
    linear."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.table = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, ids):
        return self.proj(self.table(ids))


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n))


@pytest.mark.inductor
@torch.no_grad()
def test_packages_of_two_sizes_share_their_equal_constants(real_defaults, tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Lookup().eval()
    cache = tmp_path / "cache"
    compiled = compile_sb(model, cache_dir=str(cache), compile_sizes=[2, 4], store_frozen="inline")
    for n in (2, 3, 4):
        torch.testing.assert_close(compiled(_ids(n)), model(_ids(n)), **TOL)
    paths = _packages(cache, tmp_path)
    assert sorted(paths) == [2, 4]
    del compiled  # and with it the packages it serves from
    _restart()
    gc.collect()

    def table_of(package):
        (name,) = [n for n, t in package.constants.items()
                   if t.shape == model.table.weight.shape and torch.equal(t, model.table.weight)]
        return package.constants[name]

    before = aoti.SHARED.reused
    two, four = aoti.load_aligned(paths[2]), aoti.load_aligned(paths[4])
    assert isinstance(two, aoti.AlignedCpuPackage) and isinstance(four, aoti.AlignedCpuPackage)
    # The libraries' own pages of their constants, read once at load, given back.
    for package, path in ((two, paths[2]), (four, paths[4])):
        with zipfile.ZipFile(path) as archive:
            (lib,) = [n for n in archive.namelist() if n.endswith(".so")]
            start, end = aoti.embedded_constants(archive.read(lib))
        assert 0 < package.embedded_dropped <= end - start
    # One tensor for the table in both packages, on a 64-byte boundary as before.
    assert table_of(two) is table_of(four)
    assert aoti.address(table_of(four)) % aoti.ALIGNMENT == 0
    assert aoti.SHARED.reused - before >= 1
    # Each still gives the same bits as torch's loader on its package.
    for n, package in ((2, two), (4, four)):
        theirs = torch._inductor.aoti_load_package(paths[n]).loader.run([_ids(n)])
        assert all(torch.equal(a, b) for a, b in zip(package.run([_ids(n)]), theirs))

    # Counted: the table lives while a package runs on it, and is given back with the
    # last one (the container runner never lets go of it: see aoti._free).
    table = table_of(two)
    storage = table.untyped_storage()
    held = len(aoti.SHARED)
    del two, package
    gc.collect()
    assert storage.nbytes() == table.numel() * 4 and torch.equal(table_of(four), model.table.weight)
    del four
    gc.collect()
    assert storage.nbytes() == 0 and len(aoti.SHARED) < held
    again = aoti.load_aligned(paths[4])
    assert table_of(again) is not table
    assert all(aoti.address(t) % aoti.ALIGNMENT == 0 for t in again.constants.values())
    assert all(torch.equal(a, b) for a, b in zip(
        again.run([_ids(4)]), torch._inductor.aoti_load_package(paths[4]).loader.run([_ids(4)])))

    # Off: every package its own copies.
    monkeypatch.setenv("SIZEBACKEND_SHARE_CONSTANTS", "0")
    mine, yours = aoti.load_aligned(paths[2]), aoti.load_aligned(paths[4])
    assert table_of(mine) is not table_of(yours) and table_of(mine) is not table_of(again)
    assert torch.equal(table_of(mine), table_of(yours))
    # Each given back with its package, shared or not.
    storages = [t.untyped_storage() for t in mine.constants.values() if t.layout == torch.strided]
    del mine
    gc.collect()
    assert storages and all(s.nbytes() == 0 for s in storages)
    assert torch.equal(table_of(yours), model.table.weight)


def test_shared_constants_are_compared_in_full_and_counted():
    c = aoti.Constant(index=0, name="w", fqn="m.w", dtype=torch.float32, shape=(2, 2),
                      stride=(2, 1), offset=0, nbytes=16, folded=False, strided=True)
    registry = aoti.SharedConstants()
    data = memoryview(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    key = registry.key(c, data)
    tensor = torch.arange(4, dtype=torch.float32).view(2, 2)
    assert registry.add(key, tensor) and not registry.add(key, tensor.clone())
    assert registry.acquire(key, data) is tensor and registry.reused == 1 and len(registry) == 1
    # Another layout or other bytes: another key.
    assert registry.key(dataclasses.replace(c, stride=(1, 2)), data) != key
    other = memoryview(torch.arange(1, 5, dtype=torch.float32).numpy().tobytes())
    assert registry.key(c, other) != key
    # A key whose bytes differ all the same (a digest collision, forced): not handed out.
    assert registry.acquire(key, other) is None and registry.reused == 1
    # Two holders (the add and the acquire): the second release is the last.
    assert not registry.release(key, tensor)
    assert registry.release(key, tensor) and len(registry) == 0
    assert registry.acquire(key, data) is None
    # A tensor never held here (another thread's copy won the key): the caller's alone.
    assert registry.release(key, tensor.clone())
