"""The ``sizebackend`` command (also ``python -m dynamo_sizebackend``).

- ``sizebackend bench ...``: the throughput benchmark (``dynamo_sizebackend.bench``);
  every argument after ``bench`` is its own.
- ``sizebackend cache info|clear [--dir DIR] [--json]``: what the on-disk artifact cache
  holds (entries, bytes, by torch version, by kind: JIT artifacts and AOT packages, with
  what each holds and how many per size), or empty it. Text and JSON name the same
  folders: ``cache_dir`` (the option's value) and ``folder`` (where its entries are).
  ``clear`` leaves Inductor's own cache (``TORCHINDUCTOR_CACHE_DIR``) alone, and says so.
- ``sizebackend --version``.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any, Sequence


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _cache_dir(given: str | None) -> str | None:
    if given is not None:
        return given
    from ..options import SizeBackendOptions

    return SizeBackendOptions().cache_dir  # $SIZEBACKEND_CACHE_DIR or ~/.cache/...


def _cache(args: argparse.Namespace) -> int:
    from .._torch.inductor import inductor_cache_dir
    from ..cache.store import DiskCache

    root = _cache_dir(args.dir)
    if root is None:
        print("the artifact cache is disabled (SIZEBACKEND_CACHE_DIR is 'none')")
        return 0
    disk = DiskCache(root)
    # "dir" (= cache_dir) kept for scripts written against 0.1's JSON.
    where = {"cache_dir": root, "folder": disk.folder, "dir": root}
    if args.action == "clear":
        removed, freed = disk.clear()
        inductor = inductor_cache_dir()
        if args.json:
            print(json.dumps({**where, "removed": removed, "bytes": freed,
                              "inductor_cache_kept": inductor}))
        else:
            print(f"removed {removed} files ({_human(freed)}) from {disk.folder}")
            print(f"Inductor's own cache is left alone: {inductor} (TORCHINDUCTOR_CACHE_DIR); "
                  "delete it yourself to rebuild every kernel")
        return 0

    entries, unreadable = disk.entries()
    by_torch: dict[str, dict[str, int]] = defaultdict(lambda: {"entries": 0, "bytes": 0})
    by_kind: dict[str, dict[str, Any]] = {
        kind: {"entries": 0, "bytes": 0, "sizes": {}, "holds": holds} for kind, holds in KINDS.items()
    }
    for entry in entries:
        by_torch[entry.torch]["entries"] += 1
        by_torch[entry.torch]["bytes"] += entry.bytes
        row = by_kind.setdefault(entry.kind, {"entries": 0, "bytes": 0, "sizes": {},
                                              "holds": "unknown (a newer package wrote it)"})
        row["entries"] += 1
        row["bytes"] += entry.bytes
        row["sizes"][entry.size] = row["sizes"].get(entry.size, 0) + 1
    total = sum(e.bytes for e in entries)
    if args.json:
        print(json.dumps({**where, "entries": len(entries), "bytes": total,
                          "unreadable": unreadable, "by_torch_version": dict(by_torch),
                          "by_kind": by_kind}))
        return 0
    print(f"cache_dir: {root}")
    print(f"folder: {disk.folder}")
    print(f"entries: {len(entries)} ({_human(total)})")
    if unreadable:
        print(f"unreadable entries: {unreadable} (recompiled and replaced when next needed)")
    for version, row in sorted(by_torch.items()):
        print(f"  torch {version}: {row['entries']} entries, {_human(row['bytes'])}")
    for kind, row in by_kind.items():
        sizes = ", ".join(f"{size}: {n}" for size, n in sorted(row["sizes"].items(), key=_size_order))
        print(f"  {kind}: {row['entries']} entries, {_human(row['bytes'])}"
              f"{f' (by size: {sizes})' if sizes else ''}; {row['holds']}")
    return 0


#: What each kind of entry holds, as ``cache info`` says it.
KINDS = {
    "jit": "Inductor's generated code of a piece (standalone_compile), no weights: "
           "identical layers share one",
    "aot": "an AOTInductor package of a frozen sized piece: its compiled .so and its "
           "frozen weights, one per layer and size",
}


def _size_order(item: tuple[str, int]) -> tuple[int, int | str]:
    size = item[0]
    return (0, int(size)) if size.isdigit() else (1, size)


def _bench(bench_args: list[str]) -> int:
    from .bench import main as bench_main  # loaded only when asked: it builds models

    result = bench_main(bench_args)
    return result if isinstance(result, int) else 0


def _version() -> str:
    import torch

    from .. import __version__

    return f"dynamo_sizebackend {__version__} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sizebackend", description="dynamo_sizebackend: benchmark and artifact cache")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="throughput benchmark on the built-in model",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="arguments of the benchmark (see 'sizebackend bench --help')")

    cache = sub.add_parser("cache", help="inspect or empty the on-disk artifact cache")
    cache.add_argument("action", choices=("info", "clear"))
    cache.add_argument("--dir", default=None,
                       help="cache folder (default: $SIZEBACKEND_CACHE_DIR, else "
                            "~/.cache/dynamo_sizebackend)")
    cache.add_argument("--json", action="store_true", help="print one JSON object")
    cache.set_defaults(run=_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # all the rest is the benchmark's, --help included
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)
