"""Dynamo's recompile limit on a frame of ours: counted in stats(), warned about once.

The Hugging Face scenario that leads there is in tests/models/test_hf_generate.py; these
reach the limit in a few calls with ``torch.compile(recompile_limit=2)`` and a new dtype
per call (each one a guard failure, so a recompile).
"""
import warnings

import torch

import dynamo_sizebackend as sb
from dynamo_sizebackend.runtime.recompile_limit import RecompileLimitWarning

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def double_relu(x):
    return torch.relu(x) * 2


def negate(x):
    return -x


def run_dtypes(compiled, fn):
    for dtype in DTYPES:
        x = torch.linspace(-1, 1, 12, dtype=dtype).reshape(4, 3)
        torch.testing.assert_close(compiled(x), fn(x))


def limit_warnings(record):
    return [w for w in record if issubclass(w.category, RecompileLimitWarning)]


def test_counted_once_per_frame_and_warned_once():
    first = torch.compile(double_relu, backend="sizebackend", recompile_limit=2,
                          options={"compiler": "eager"})
    second = torch.compile(negate, backend="sizebackend", recompile_limit=2,
                           options={"compiler": "eager"})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_dtypes(first, double_relu)
        run_dtypes(second, negate)
    s = sb.stats()
    # Per function: float32 and float64 compiled (2 graphs), float16 hits the limit and
    # the code turns RUN_ONLY, so bfloat16 does not even ask Dynamo again: one hit per code.
    assert s.graphs == 4
    assert s.fallbacks == {"recompile_limit": 2}
    # The loss itself: 8 calls, of which only the 4 compiled ones reached our graphs.
    assert sum(s.calls.values()) == 4
    (warning,) = limit_warnings(record)  # one per process, not one per frame
    message = str(warning.message)
    assert "'double_relu'" in message and "recompile_limit (2)" in message
    assert 'cache_implementation="static"' in message and "StaticCache" in message
    assert "recompile_limit=N" in message and "mark_unbacked" in message


def test_warned_again_after_dynamo_reset():
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(negate, backend="sizebackend", recompile_limit=2,
                                 options={"compiler": "eager"})
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            run_dtypes(compiled, negate)
        assert len(limit_warnings(record)) == 1
    assert sb.stats().fallbacks == {"recompile_limit": 2}


def test_frames_of_other_backends_are_not_ours():
    ours = torch.compile(double_relu, backend="sizebackend", options={"compiler": "eager"})
    ours(torch.ones(2, 3))  # installs the watch
    theirs = torch.compile(negate, backend="eager", recompile_limit=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_dtypes(theirs, negate)
    hits = torch._dynamo.utils.counters["unimplemented"]
    assert any("recompile limit exceeded" in reason for reason in hits)  # Dynamo did hit it
    assert limit_warnings(record) == []
    assert sb.stats().fallbacks == {}

