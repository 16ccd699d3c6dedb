"""benchmarks/bench_latency.py's timing loop: turns of timed calls, each after untimed
warm calls, the variants in rotating order."""
from . import load_benchmark


def test_turns_time_only_the_calls_after_the_warm_ones(monkeypatch):
    bl = load_benchmark("bench_latency")
    monkeypatch.setattr(bl, "CHUNK_STEPS", 2)
    monkeypatch.setattr(bl, "WARM_CALLS", 1)
    clock, calls = [0.0], []

    def variant(name, seconds):
        def call():  # ten times slower right after the other variant's call
            clock[0] += seconds * (10 if calls and calls[-1] != name else 1)
            calls.append(name)
        return call

    monkeypatch.setattr(bl.time, "perf_counter", lambda: clock[0])
    got = bl.interleaved({"a": variant("a", 1.0), "b": variant("b", 3.0)}, iters=3)
    assert got == {"a": 1.0, "b": 3.0}  # no timed call came right after the other's
    # 3 untimed calls each first; then turns of 1 warm + 2 timed, 1 warm + the last 1.
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3 + ["b"] * 2 + ["a"] * 2
