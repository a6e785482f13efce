"""Pick each quantized layer's kernel by timing the candidates at every row bucket at load.

A wrong pick can cost 10x (torch's CPU int4 kernel with fp32 activations on an AVX2-only CPU), and
which pick is right differs between CPUs, so nothing is assumed: layers are grouped by (format,
shape), each group's candidates are timed on its own weights at every row bucket, and the fastest
wins; the choice is kept per machine (choice_cache), so later loads skip the timing and never swap
two near-equal kernels between starts. A candidate more than SLOW_CUTOFF times slower than the best
is not timed at larger buckets (they only get worse), once a second timing of the bucket agrees: a busy spell
on the machine once made int8x2 look 4.5x slower than int8 at 8 rows, and the cut handed int8 activations the
biggest layers of a 1.1B model, kept for every later load. A layer runs one kernel at every row count,
so a row gets the same result alone and in a batch. The pool: the precise kernels (activations kept to ~15 bits or more,
`Kernel.precise`) if one costs at most PRECISION_MARGIN over the fastest, else all of them
(`forced="fast"`: always all; llama.cpp's arithmetic, int8 activations, wins on our CPUs). The
winner: the exact path (fp32 activations) if it is within PREFER_MARGIN of the pool's best at every
bucket, else the kernel whose worst bucket is least behind the pool's best there. The result is
logged and stays off the hot path.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from minivllm.quant import choice_cache
from minivllm.quant.linear import QuantLinear

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 256)  # decode batches up to 64 sequences; 256: prefill chunks
SLOW_CUTOFF = 4.0
PREFER_MARGIN = 1.10
# What precision may cost: measured 1.1-1.5x for int8x2 over int8 activations (memory-bound at 1 row,
# compute-bound at 32); torch's fp32-activation 4-bit kernel, 10-20x, is not worth it
PRECISION_MARGIN = 2.0
FAST = "fast"
REPEATS = 3
WEIGHTS_PER_TIMING = 2  # rotate through two layers' weights so timings include some memory traffic
HEAD_MAX_ROWS = 64  # the LM head only sees rows that need logits: one per sequence

log = logging.getLogger(__name__)


@dataclass
class GroupChoice:
    key: str  # "int4 g32 [960x576]"
    layers: int
    plan: list[tuple[int, str]]  # (max rows, kernel name)
    timings_ms: dict[int, dict[str, float]]  # bucket -> kernel -> ms per call
    cached: bool = False  # the plan this machine's earlier timing chose (choice_cache)


def choose_kernels(
    layers: list[QuantLinear], forced: str | None = None, buckets: tuple[int, ...] = ROW_BUCKETS
) -> list[GroupChoice]:
    """Time and set every layer's plan; `forced` (a kernel name, an activation precision, or "exact")
    skips the timing, "fast" times every candidate with no preference for precision."""
    groups: dict[str, list[QuantLinear]] = defaultdict(list)
    for layer in layers:
        groups[f"{layer.format} [{layer.out_features}x{layer.in_features}]"].append(layer)
    choices = []
    for key, members in groups.items():
        cached = False
        if forced not in (None, FAST):
            plan, timings = [(buckets[-1], _forced_name(forced, members[0]))], {}
        else:
            plan, timings, cached = _timed_plan(key, members, buckets, forced)
            if forced is None:
                _warn_if_imprecise(key, plan, members[0])
        for layer in members:
            layer.set_plan(plan)
            layer.drop_unused()
        choices.append(GroupChoice(key, len(members), plan, timings, cached))
    return choices


def _timed_plan(key: str, members: list[QuantLinear], buckets: tuple[int, ...], forced: str | None):
    """The plan this machine chose before for this group (choice_cache), else a timing's, kept for
    the next load. Returns (plan, timings, whether it came from the cache)."""
    layer = members[0]
    head = layer.name == "lm_head"
    names = [k.name for k in layer.candidates]
    device = next(iter(layer.candidates[0].tensors())).device
    entry = choice_cache.entry_key(device, f"{key}{' head' if head else ''} {buckets}", names, forced)
    return choice_cache.kept_or_timed(
        entry,
        lambda: _time_group(members, tuple(b for b in buckets if b <= HEAD_MAX_ROWS or not head)),
        lambda timings: _plan_from(timings, layer, prefer_precise=forced != FAST),
        usable=lambda plan: all(name in names for _, name in plan),
    )


def _warn_if_imprecise(key: str, plan: list[tuple[int, str]], layer: QuantLinear) -> None:
    """Says so when the default (precise) choice had to take a coarser kernel: no precise one within
    PRECISION_MARGIN of the fastest, so this group computes with less precise activations."""
    precise = {k.name for k in layer.candidates if k.precise}
    chosen = {name for _, name in plan}
    if precise and not chosen & precise:
        log.warning(
            "%s: no precise kernel (%s) within %.1fx of the fastest; %s runs it",
            key,
            ", ".join(sorted(precise)),
            PRECISION_MARGIN,
            ", ".join(sorted(chosen)),
        )


def _forced_name(forced: str, layer: QuantLinear) -> str:
    """`forced` is a kernel name ("int4pack/bf16"), an activation precision that every format
    offers ("bf16", "fp32"), or "exact": each format's exact path."""
    names = [k.name for k in layer.candidates]
    if forced == "exact":
        return next((k.name for k in layer.candidates if k.exact), names[-1])
    by_precision = [n for n in names if n.endswith("/" + forced)]
    return forced if forced in names or not by_precision else by_precision[0]


def _time_group(members: list[QuantLinear], buckets) -> dict[int, dict[str, float]]:
    sample = members[:WEIGHTS_PER_TIMING]
    names = [k.name for k in members[0].candidates]
    alive = set(names)
    timings: dict[int, dict[str, float]] = {}
    device = next(iter(sample[0].candidates[0].tensors())).device
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for rows in buckets:
        x = torch.randn(rows, members[0].in_features, device=device, dtype=dtype)
        timed = [n for n in names if n in alive]
        timings[rows] = _time_in_turns(sample, timed, x)
        slow = _too_slow(timings[rows])
        if slow:  # a cut lasts for every larger bucket: confirmed by a second timing
            again = _time_in_turns(sample, timed, x)
            timings[rows] = {n: min(ms, again[n]) for n, ms in timings[rows].items()}
            slow = _too_slow(timings[rows])
        alive = set(timings[rows]) - slow
    return timings


def _too_slow(bucket: dict[str, float]) -> set[str]:
    """The kernels more than SLOW_CUTOFF times slower than the bucket's best."""
    best = min(bucket.values())
    return {n for n, ms in bucket.items() if ms > SLOW_CUTOFF * best}


def _time_in_turns(sample: list[QuantLinear], names: list[str], x: torch.Tensor) -> dict[str, float]:
    """Each kernel's best of REPEATS runs in ms a call, the kernels taking turns (choice_cache.best_in_turns)."""
    kernels = {name: [next(k for k in layer.candidates if k.name == name) for layer in sample] for name in names}
    for calls in kernels.values():
        calls[0](x)  # warm-up: a first call allocates and may select a oneDNN primitive
    runs = {name: functools.partial(_seconds_a_call, calls, x) for name, calls in kernels.items()}
    return {name: seconds * 1e3 for name, seconds in choice_cache.best_in_turns(runs, REPEATS).items()}


def _seconds_a_call(calls: list, x: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for call in calls:
        call(x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(calls)


def _score(timings: dict[int, dict[str, float]], name: str) -> float:
    """Geometric mean over buckets of the kernel's time over the bucket's best (1: the fastest
    everywhere; a kernel cut at a bucket for being slow scores infinity)."""
    ratios = [t.get(name, math.inf) / min(t.values()) for t in timings.values()]
    return math.exp(statistics.fmean(map(math.log, ratios)))


def _worst(timings: dict[int, dict[str, float]], name: str, pool: list[str]) -> float:
    """The kernel's largest time over the best of `pool`, over all buckets."""
    return max(t.get(name, math.inf) / min(t.get(n, math.inf) for n in pool) for t in timings.values())


def _plan_from(
    timings: dict[int, dict[str, float]], layer: QuantLinear, prefer_precise: bool = True
) -> list[tuple[int, str]]:
    """One kernel for every row count. The pool: the precise kernels if one of them costs at most
    PRECISION_MARGIN on average (geometric mean over buckets of its time over the best), else all.
    From the pool, the kernel whose worst bucket is least behind the pool's best there (a mean would
    let prefill buckets outvote single-stream decode: measured, an exact head 2.3x slower at one row
    won on the mean); the exact one if it is within PREFER_MARGIN of the best at every bucket.

    A kernel per bucket let a row's result depend on how many rows shared its step (measured: with
    int8 activations alone and fp32 ones in a batch of 8, a request parted from its alone run by
    0.38 nats), and could keep two stored forms of a weight (160 MiB instead of 97); with one kernel,
    and ours computing each row alone, neither."""
    scores = {k.name: _score(timings, k.name) for k in layer.candidates}
    best = min(scores.values())
    precise = [k.name for k in layer.candidates if k.precise and scores[k.name] <= best * PRECISION_MARGIN]
    pool = precise if prefer_precise and precise else list(scores)
    worst = {n: _worst(timings, n, pool) for n in pool}
    # exact only if within the margin of the best at every bucket: comparing worst cases alone let an
    # exact LM head 2.3x slower at one row tie with int8x2 (whose worst, 2.05x, is at 64 rows)
    exact = [k.name for k in layer.candidates if k.exact and k.name in pool and worst[k.name] <= PREFER_MARGIN]
    return [(max(timings), exact[0] if exact else min(pool, key=worst.get))]


def describe(choices: list[GroupChoice]) -> list[str]:
    lines = []
    for c in choices:
        steps = ", ".join(
            f"{'rows <= ' + str(rows) if i < len(c.plan) - 1 else 'more rows' if i else 'all rows'}: {name}"
            for i, (rows, name) in enumerate(c.plan)
        )
        lines.append(f"{c.key} x{c.layers}: {steps}")
    return lines
