"""One measurement of a benchmark script, in a fresh Python process of its own: the
script is run again with ``--child SPEC`` and prints its result as the last line of
JSON. The process gets its own Inductor and sizebackend cache folders."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable


def run(script: str, spec: dict, inductor_dir: str, cache_dir: str,
        drop_env: tuple[str, ...] = ()) -> tuple[dict, float, float]:
    """``(result, spawn time, exit time)``, times by ``time.time()``; raises with the
    child's stderr when it fails."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, SIZEBACKEND_CACHE_DIR=cache_dir)
    for name in drop_env:
        env.pop(name, None)
    start = time.time()
    done = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    end = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), start, end


def parse_or_serve(parser: argparse.ArgumentParser, child: Callable[[dict], dict],
                   argv: list[str] | None) -> argparse.Namespace | None:
    """The parent's arguments; or, run as ``--child SPEC`` by :func:`run`, ``None``
    after printing ``child(SPEC)`` as the last line of JSON."""
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return None
    return args
