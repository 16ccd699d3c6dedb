"""What torch's own tools show of the backend (issue 22): profiler ranges per piece and
size, and ``TORCH_TRACE`` artifacts read back from the files torch writes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dynamo_sizebackend as sb

from .nets import TinyTransformer, batch, compile_sb

REPO = Path(__file__).resolve().parents[1]


def _ranges(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("sizebackend/")]


@torch.no_grad()
def test_every_piece_call_is_a_profiler_range_named_by_graph_piece_and_size():
    model = TinyTransformer(layers=2).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    torch.testing.assert_close(compiled(batch(3)), model(batch(3)))  # compiles
    # 2 attention layers: 3 compiled pieces and 2 split-op pieces between them.
    sized = _ranges(lambda: compiled(batch(4)))
    assert len(sized) == 5 and all(re.fullmatch(r"sizebackend/g\d+/piece\d/size4", n) for n in sized)
    assert len({n.rsplit("/", 2)[0] for n in sized}) == 1  # one graph
    assert sorted(int(n.split("/")[2][5:]) for n in sized) == [0, 1, 2, 3, 4]
    general = _ranges(lambda: compiled(batch(5)))
    assert len(general) == 5 and all(n.endswith("/dynamic") for n in general)
    # No profiler: no range, the same results.
    with sb.expect(calls={4: 1}):
        torch.testing.assert_close(compiled(batch(4)), model(batch(4)))


_CHILD = textwrap.dedent("""
    import torch
    from tests.nets import TinyTransformer, batch, compile_sb

    model = TinyTransformer(layers=1).eval()
    compiled = compile_sb(model, compile_sizes=[4], compiler="eager")
    with torch.no_grad():
        for n in (3, 4):
            torch.testing.assert_close(compiled(batch(n)), model(batch(n)))
""")


def _artifacts(folder: Path) -> list[tuple[str, dict]]:
    """``(name, payload)`` of every ``sizebackend_*`` artifact in torch's trace files: a
    glog-prefixed JSON line per record, its payload on the tab-indented lines after."""
    found = []
    for path in sorted(folder.iterdir()):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if '"sizebackend_' not in line:
                continue
            meta = json.loads(line[line.index("{"):])
            name = meta["artifact"]["name"]
            body = []
            for more in lines[i + 1:]:
                if not more.startswith("\t"):
                    break
                body.append(more[1:])
            found.append((name, json.loads("\n".join(body))))
    return found


def test_torch_trace_and_torch_logs_show_the_split_and_every_piece_compile(tmp_path):
    trace = tmp_path / "trace"
    env = dict(os.environ, TORCH_TRACE=str(trace), TORCH_LOGS="+dynamo_sizebackend")
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env, check=True,
                          capture_output=True, text=True, timeout=600)
    # TORCH_LOGS: INFO, a line per graph and per size with seconds; DEBUG, per piece
    # and the first dispatch of each size.
    log = done.stderr
    assert re.search(r"graph \d+: 3 pieces \(1 split ops\), dynamic shape: 2 pieces in "
                     r"[\d.]+s \(2 compiled, 0 loaded, 0 reused\)", log), log[-3000:]
    assert re.search(r"graph \d+: size 4: 2 pieces in [\d.]+s \(2 compiled", log)
    assert re.search(r"compiled graph\d+_submod_0 for size 4 with eager", log)
    assert re.search(r"first call of size 4 runs its own pieces", log)
    assert re.search(r"first call of size 3 runs the general pieces \(not a listed size", log)
    artifacts = _artifacts(trace)
    splits = [p for n, p in artifacts if n == "sizebackend_split"]
    assert len(splits) == 1
    split = splits[0]
    assert split["sizes"] == [4] and split["shape"] == "dynamic"
    assert [p["split_op"] for p in split["pieces"]] == [False, True, False]
    pieces = [p for n, p in artifacts if n == "sizebackend_piece"]
    # 2 compiled pieces, general and size 4, each compiled (the eager adaptor: no cache).
    assert sorted((p["piece"], p["size"]) for p in pieces) == [
        ("submod_0", "4"), ("submod_0", "dynamic"), ("submod_2", "4"), ("submod_2", "dynamic")]
    assert all(p["outcome"] == "compiled" and p["seconds"] >= 0 for p in pieces)


_DEFAULTS_CHILD = textwrap.dedent("""
    import sys
    import torch
    import dynamo_sizebackend as sb
    from tests.nets import MLP

    torch.manual_seed(0)
    model = MLP().eval()
    compiled = torch.compile(model, backend="sizebackend", dynamic=True,
                             options={"compile_sizes": [4], "cache_dir": sys.argv[1]})
    with torch.no_grad():
        for n in (3, 4):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), model(x))
    assert sb.wait_for_packages(timeout=300).pending == 0
""")


@pytest.mark.inductor
def test_the_trace_of_a_cold_and_a_warm_start_with_the_real_defaults(tmp_path):
    """Inductor and the real sized defaults (frozen, autotuned, stored by the package
    worker): the cold start traces two compiles with their output code, the warm one
    two cache hits, the size-4 one an AOT package."""
    env = {k: v for k, v in os.environ.items() if k != "SIZEBACKEND_SIZED_INDUCTOR_OPTIONS"}
    runs = {}
    for start in ("cold", "warm"):
        trace = tmp_path / start
        subprocess.run([sys.executable, "-c", _DEFAULTS_CHILD, str(tmp_path / "cache")], cwd=REPO,
                       env={**env, "TORCH_TRACE": str(trace)}, check=True, capture_output=True,
                       text=True, timeout=900)
        runs[start] = {p["size"]: p for n, p in _artifacts(trace) if n == "sizebackend_piece"}
    cold, warm = runs["cold"], runs["warm"]
    assert {k: (p["outcome"], p["frozen"], p["package"]) for k, p in cold.items()} == {
        "dynamic": ("compiled", False, False), "4": ("compiled", True, False)}
    assert os.path.exists(cold["dynamic"]["output_code"])  # Inductor's generated module
    assert {k: (p["outcome"], p["package"]) for k, p in warm.items()} == {
        "dynamic": ("cache_hit", False), "4": ("cache_hit", True)}
