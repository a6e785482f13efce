"""`minivllm bench profile`: where one engine step's time goes at a given concurrency.

Engine phases come from the StepFinished events (schedule, forward, sample, post-process); the
forward pass is split by operator category with torch.profiler, and what the operators do not
account for is Python / dispatch overhead. Where decode steps run natively (decode_step.cpp), the call's
own parts (products, attention, rotary + K/V store, norms + residuals, SiLU) are timed from inside it
during the unprofiled steps, with the rate at which the products read the layers' weights."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

from minivllm.bench.common import chat_prompt_ids, greedy, median, progress
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.kernels.cpu import native

CATEGORIES = {
    "GEMM (linear layers, LM head)": (
        "aten::mm",
        "aten::addmm",
        "mkl::_mkl_linear",
        "aten::linear",
        "aten::_weight_int4pack_mm_for_cpu",
        "aten::_weight_int8pack_mm",
        "aten::_weight_int4pack_mm",
        *(f"minivllm_native::{w}_{a}_linear" for w in ("q4", "i8") for a in ("q8", "q8x2", "f32")),
        "minivllm_native::f32_linear",
        "minivllm_native::kquant_linear",
    ),
    "native decode step: every layer, products included": ("minivllm_native::decode_layers",),
    "attention: K/V gather through block tables": ("aten::index", "aten::index_select"),
    "attention: scores, softmax, weighted sum": (
        "aten::bmm",
        "aten::_softmax",
        "aten::masked_fill_",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "minivllm_native::paged_decode_attention",
    ),
    "KV cache write (slot mapping)": ("aten::index_copy_",),
    "norms, rotary, SwiGLU, residuals": (
        "aten::_fused_rms_norm",
        "aten::silu",
        "aten::mul",
        "aten::add",
        "aten::cat",
        "aten::neg",
        "aten::pow",
        "aten::mean",
        "aten::rsqrt",
        "aten::flip",
    ),
}


def bench_profile(engine, args) -> int:
    from torch.profiler import ProfilerActivity, profile

    level = args.concurrency[-1]
    prompts = chat_prompt_ids(engine.tokenizer, (CHAT_PROMPTS * 4)[:level])
    for i, p in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt_token_ids=p, params=greedy(args.max_tokens))
    progress(f"prefilling {level} requests")
    while any(r.status.value in ("WAITING", "PREFILL") for r in engine.requests.values()):
        engine.step()
    progress(f"timing decode steps at {level} concurrent")
    native_step = getattr(engine.loaded.model, "native_step", None)
    timed = max(4, min(32, args.max_tokens // 3))
    warm = min(WARM_STEPS, max(0, args.max_tokens - 1 - timed - PROFILED_STEPS) // FLOOR_ROUNDS)
    with _native_part_clocks(native_step is not None):
        rounds = _timed_rounds(engine, timed, warm)
        inside = native.decode_part_times() if native_step is not None else None
    steps = [step for _, round_steps in rounds for step in round_steps]
    progress("profiling operators")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
    while engine.has_work():
        engine.step()
    _report(steps, prof, level)
    if inside is not None:
        _print_native_parts(*inside, native_step.product_bytes)
    _print_floor(engine, level, rounds, warm)
    return 0


@contextlib.contextmanager
def _native_part_clocks(on: bool):
    """The native decode step's per-part clocks, on for the timed steps only (~330 clock reads, ~10 us a step)."""
    if not on:
        yield
        return
    native.decode_part_times()  # from zero
    native.decode_part_timing(True)
    try:
        yield
    finally:
        native.decode_part_timing(False)


def _print_native_parts(parts: dict[str, float], whole: float, calls: int, product_bytes: int) -> None:
    """The native call's parts, per call, timed around each in the unprofiled steps: the products' rate is
    what the floor assumes of every weight byte."""
    if calls == 0:
        print("\nthe native decode step did not run in the timed steps (a kernel plan not ours at this row count)")
        return
    print(f"\ninside the native decode step (wall time around each part, mean of {calls} timed calls):")
    for name, seconds in parts.items():
        if name == "all-reduce" and seconds == 0:  # one rank: nothing summed
            continue
        rate = ""
        if name == "products" and seconds > 0:
            rate = (
                f"   ({product_bytes / 2**20:.3g} MiB of layer weights at "
                f"{significant(product_bytes * calls / seconds / 1e9)} GB/s)"
            )
        print(f"  {name:<24} {seconds / calls * 1e3:7.2f} ms{rate}")
    rest = whole - sum(parts.values())
    print(f"  {'the rest of the call':<24} {rest / calls * 1e3:7.2f} ms   (checks, buffers, the final norm)")
    print(f"  {'whole call':<24} {whole / calls * 1e3:7.2f} ms")


def significant(value: float, digits: int = 3) -> str:
    """`value` in plain decimals with `digits` significant ones: a slow reading (a busy box, a tiny
    model) prints as 0.00583, never as 0.0 or in exponent form."""
    if value <= 0 or not math.isfinite(value):
        return f"{value:.1f}"
    return f"{value:.{max(0, digits - 1 - math.floor(math.log10(value)))}f}"


FLOOR_ROUNDS = 4  # the timed steps come in this many rounds, each after a bandwidth reading of its own
# Untimed steps after each reading: the first decode steps after it (or after any pause) run ~1 ms slower at one
# sequence while the threads and caches warm up (4.6-5.0 ms, then 3.5-3.9; docs/ARCHITECTURE.md). A served
# decode follows its prefill or the step before, so the steady steps are what a stream's tokens cost.
WARM_STEPS = 4


def _timed_rounds(engine, count: int, warm: int = 0) -> list[tuple[float, list]]:
    """`count` decode steps in FLOOR_ROUNDS rounds, as (streaming GB/s measured just before, the round's
    StepFinished events), each round's timed steps after `warm` untimed ones. A box's memory bandwidth drifts
    by 1.5x within minutes (docs/ARCHITECTURE.md), so a floor read once, after the steps, could belong to
    another phase than the steps it divides."""
    from minivllm.bench.machine import streaming_bandwidth_gbs

    rounds = []
    for r in range(FLOOR_ROUNDS):
        bandwidth, steps = streaming_bandwidth_gbs(repeats=3), []
        for _ in range(warm):
            engine.step()
        unsubscribe = engine.bus.subscribe(lambda e: steps.append(e) if type(e).__name__ == "StepFinished" else None)
        for _ in range(count * (r + 1) // FLOOR_ROUNDS - count * r // FLOOR_ROUNDS):
            engine.step()
        unsubscribe()
        rounds.append((bandwidth, steps))
    return rounds


def _print_floor(engine, rows: int, rounds: list[tuple[float, list]], warm: int) -> None:
    """The weight-read floor: a decode step cannot be faster than streaming its weights once. Each round's
    median step is divided by the floor at the bandwidth read just before it; the median ratio is reported."""
    from minivllm.bench.machine import cpu_capability
    from minivllm.loader.install_quantized import streamed_bytes

    read = streamed_bytes(engine.loaded.model, rows)
    timed = [(bandwidth, median([st.duration_ms for st in steps])) for bandwidth, steps in rounds if steps]
    if not timed:
        print("\nno decode step was timed (the requests finished first): no floor to compare with")
        return
    ratios = sorted(step_ms / (read / bandwidth / 1e6) for bandwidth, step_ms in timed)
    bandwidths = sorted(bandwidth for bandwidth, _ in timed)
    bandwidth = median(bandwidths)
    print(
        f"\nweight-read floor at {rows} rows: {read / 2**20:.0f} MiB of weights per step / {bandwidth:.1f} GB/s "
        f"(CPU {cpu_capability()}; {bandwidths[0]:.1f}-{bandwidths[-1]:.1f} GB/s read before each of "
        f"{len(timed)} rounds of steps, {warm} untimed after each reading) = {read / bandwidth / 1e6:.1f} ms; "
        f"this step is {median(ratios):.2f}x "
        f"the floor (median of the rounds, each against its own reading: {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
    )


PROFILED_STEPS = 4
# profiler entries of a torch.compile'd region (their names carry a per-graph hash)
COMPILED_PREFIXES = (
    "## Call CompiledFxGraph",
    "Torch-Compiled Region",
    "TorchDynamo Cache Lookup",
    "Pregraph bytecode",
    "AOTDispatcher",
)


def _report(steps, prof, level: int) -> None:
    n = len(steps)
    phases = {
        k: median([getattr(s, k) for s in steps]) for k in ("schedule_ms", "forward_ms", "sample_ms", "postprocess_ms")
    }
    total = median([s.duration_ms for s in steps])
    print(f"\n== one decode step at {level} concurrent (median of {n} steps) ==")
    print(machine_line())
    print(f"total step {total:.1f} ms  ({level / total * 1e3:.0f} tokens/s)")
    for key, value in phases.items():
        print(f"  {key.removesuffix('_ms'):<12} {value:7.2f} ms  {value / total:6.1%}")
    self_us: dict[str, float] = defaultdict(float)
    for item in prof.key_averages():
        self_us[item.key] += item.self_cpu_time_total
    forward_ms = phases["forward_ms"]
    n = PROFILED_STEPS
    compiled_keys = [k for k in self_us if k.startswith(COMPILED_PREFIXES)]
    print("\nforward pass by operator category (profiled self time per step, vs the unprofiled forward):")
    accounted = 0.0
    for category, names in CATEGORIES.items():
        ms = sum(self_us.get(name, 0.0) for name in names) / n / 1e3
        accounted += ms
        print(f"  {category:<45} {ms:7.2f} ms  {ms / forward_ms:6.1%} of forward")
    if compiled_keys:  # the compiled layer step's own kernels, its wrapper and dynamo's guard checks
        ms = sum(self_us[k] for k in compiled_keys) / n / 1e3
        accounted += ms
        print(f"  {'compiled layer step: fused kernels, guards':<45} {ms:7.2f} ms  {ms / forward_ms:6.1%} of forward")
    other_ops = sum(self_us.values()) / n / 1e3 - accounted
    print(f"  {'other operators (views, copies, sampling ops)':<45} {other_ops:7.2f} ms")
    print(f"  {'Python and dispatch overhead (forward - operators)':<45} {forward_ms - accounted - other_ops:7.2f} ms")
    print("  (the profiler inflates small operators, so the overhead line is a lower bound)")
