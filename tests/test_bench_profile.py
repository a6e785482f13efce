"""`bench profile`'s timed rounds (bench/profile.py): each round reads the bandwidth, runs its untimed warm-up
steps, then times its share of the steps: only those steps' StepFinished events are kept."""

from __future__ import annotations

from engine_utils import make_engine
from minivllm.bench import profile
from minivllm.sampling.params import SamplingParams


def test_each_round_times_its_steps_after_a_reading_and_its_untimed_warm_up(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    engine.add_request(
        "r", prompt_token_ids=list(range(1, 20)), params=SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    )
    prefill: list = []
    unsubscribe = engine.bus.subscribe(lambda e: prefill.append(e.step) if type(e).__name__ == "StepFinished" else None)
    engine.step()  # the prefill
    unsubscribe()
    log: list[str] = []  # "read" at each bandwidth reading, then the engine step number of each step

    def reading(repeats: int) -> float:
        log.append("read")
        return float(log.count("read"))

    monkeypatch.setattr("minivllm.bench.machine.streaming_bandwidth_gbs", reading)
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: log.append("step") or real_step())
    rounds = profile._timed_rounds(engine, 10, warm=3)
    assert [bandwidth for bandwidth, _ in rounds] == [1.0, 2.0, 3.0, 4.0]  # a reading a round, in order
    assert [len(steps) for _, steps in rounds] == [2, 3, 2, 3]  # the 10 timed steps over 4 rounds
    # each round: its reading, 3 untimed steps, then its timed ones; the timed events are those last steps'
    assert log == [entry for _, steps in rounds for entry in ["read"] + ["step"] * (3 + len(steps))]
    first = prefill[0] + 1 + 3  # the first round's warm-up comes first
    numbers = [e.step for _, steps in rounds for e in steps]
    assert numbers == [
        first,
        first + 1,
        first + 5,
        first + 6,
        first + 7,
        first + 11,
        first + 12,
        first + 16,
        first + 17,
        first + 18,
    ]


def test_every_native_product_op_counts_as_a_product():
    """Each linear operator the native kernels register (`*_linear` in their sources) is in the profile's
    product category: one left out showed a K-quant model's products as "other operators"."""
    import re
    from pathlib import Path

    sources = Path(profile.__file__).parents[1] / "kernels" / "cpu"
    defined = {
        f"minivllm_native::{name}"
        for path in sources.glob("*.cpp")
        for name in re.findall(r'm\.def\("(\w+_linear)\(', path.read_text())
    }
    assert "minivllm_native::kquant_linear" in defined and len(defined) >= 6
    assert defined <= set(profile.CATEGORIES["GEMM (linear layers, LM head)"])
