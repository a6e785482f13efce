"""What the dashboard's step profile costs a decode step (engine/step_profile.py), in-process A/B.

Variants run in alternating pairs on one engine (the order flipping each pair) so that a noisy box's drift hits
them alike; each variant runs a few steps per turn, the first untimed (switching runs on the next step):
- closed: the profiler present, no client watching (what every served step pays);
- none: no profiler at all (the engine before the profile existed, but for one small dict per step);
- open: a client watching: the native part clocks on and the floors computed.
Prints each variant's median step time and the ratios. Usage: python scripts/step_profile_overhead.py [seqs] [steps]
"""

from __future__ import annotations

import statistics
import sys
import time

from minivllm.engine.config import EngineConfig
from minivllm.engine.factory import create_engine
from minivllm.sampling.params import SamplingParams


def decode_engine(seqs: int, steps: int):
    engine = create_engine(None, EngineConfig(max_num_seqs=seqs, max_model_len=2048))
    if engine.loaded.model.native_step is None:
        print("note: no native decode step here: `open` profiles the coarse phases only")
    params = SamplingParams(max_tokens=2 * steps + 32, temperature=0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"ab-{i}", f"Tell me a long story about the number {i}.", params)
    while any(r.status.value in ("WAITING", "PREFILL") for r in engine.requests.values()):
        engine.step()
    for _ in range(8):  # warm the threads and caches
        engine.step()
    return engine


def timed_step(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return (time.perf_counter() - start) * 1e3


def closed_cost_us(engine, calls: int = 100_000) -> float:
    """What the closed panel adds to a step, timed alone: the switch check before the step, the profile
    call after it, and the phases dict the event is now built from."""
    profiler = engine.telemetry.profiler
    sched = engine.scheduler.schedule()  # a decode plan (its blocks were reserved: this engine stops here)
    start = time.perf_counter()
    for _ in range(calls):
        profiler.begin_step()
        profiler.profile(sched, {"schedule": 0.1, "forward": 1.0, "sample": 0.1, "postprocess": 0.1})
    return (time.perf_counter() - start) / calls * 1e6


def paired_ratio(engine, first, second, pairs: int, block: int) -> tuple[float, float, float]:
    """Median step ms under `first` and `second` and the median of the per-pair ratios: pairs alternate
    which variant runs first; each runs `block` steps, the first of them untimed (a switch's own step)."""
    a_ms, b_ms, ratios = [], [], []
    for i in range(pairs):
        order = (first, second) if i % 2 == 0 else (second, first)
        got = {}
        for variant in order:
            variant()
            got[variant] = statistics.median([timed_step(engine) for _ in range(block)][1:] or [timed_step(engine)])
        a_ms.append(got[first])
        b_ms.append(got[second])
        ratios.append(got[first] / got[second])
    return statistics.median(a_ms), statistics.median(b_ms), statistics.median(ratios)


def main(seqs: int = 1, steps: int = 600) -> None:
    engine = decode_engine(seqs, steps)
    telemetry, profiler = engine.telemetry, engine.telemetry.profiler

    def closed():
        telemetry.profiler = profiler
        profiler.watch("ab", False)

    def none():
        telemetry.profiler = None

    def opened():
        telemetry.profiler = profiler
        profiler.watch("ab", True)

    print(f"{seqs} sequence(s), embedded model, medians of per-pair ratios:")
    c, n, r = paired_ratio(engine, closed, none, steps // 4, 2)
    print(f"  panel closed {c:.3f} ms vs no profiler {n:.3f} ms: closed / none = {r:.4f}")
    o, c, r = paired_ratio(engine, opened, closed, steps // 8, 4)
    print(f"  panel open {o:.3f} ms vs closed {c:.3f} ms: open / closed = {r:.4f}")
    closed()
    added_us = closed_cost_us(engine)
    print(f"  the closed panel's own code per step: {added_us:.2f} us = {added_us / 1e3 / c:.4%} of a closed step")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
