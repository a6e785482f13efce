"""`minivllm bench throughput --tensor-parallel-size N`: the model split over N ranks of T threads against
one process of N x T threads, on the same prompts, alternated round by round (this box is shared and noisy:
medians and ratios). The split runs twice, with its ranks summing through shared memory (each rank's native
decode step) and over gloo (eager steps: the path across machines), one after the other (a process holds one
process group at a time); one process runs its default decode path (the native step on a CPU) and eagerly."""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from minivllm.bench.common import chat_prompt_ids, greedy, median, precision_label, progress, run_engine
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.engine.factory import create_engine
from minivllm.engine.tp_workers import SHARED_MEMORY_ENV
from minivllm.engine_args import engine_config, quant_config

ROUNDS = 3


def bench_tp(args: argparse.Namespace) -> int:
    n, per_rank = args.tensor_parallel_size, args.threads or 1
    whole = n * per_rank
    singles = [  # (label, threads while it runs, engine)
        (f"TP=1, {whole} threads", whole, _engine(args, 1, whole, eager=False)),
        (f"TP=1 eager, {whole} threads", whole, _engine(args, 1, whole, eager=True)),
    ]
    levels = sorted({1, max(args.concurrency)})
    max_tokens = 16 if args.quick else args.max_tokens
    prompts = chat_prompt_ids(singles[0][2].tokenizer, (CHAT_PROMPTS * 4)[: max(levels)])
    rates: dict[tuple[str, int], list[float]] = {}
    labels = [label for label, _, _ in singles]
    for over, shared in (("shared memory", "1"), ("gloo", "0")):
        label = f"TP={n} over {over}, {per_rank} thread(s) a rank"
        os.environ[SHARED_MEMORY_ENV] = shared  # read as the ranks meet
        try:
            split = _engine(args, n, per_rank, eager=False)
        finally:
            os.environ.pop(SHARED_MEMORY_ENV)
        try:
            _rounds([*singles, (label, per_rank, split)], prompts, levels, max_tokens, rates)
        finally:
            split.close()  # the workers exit, the process group goes
        labels.append(label)
    torch.set_num_threads(whole)
    _print(rates, levels, labels, singles[0][2], max_tokens)
    return 0


def _rounds(runs: list, prompts: list, levels: list[int], max_tokens: int, rates: dict) -> None:
    """ROUNDS rounds of every run at every level, alternated; each run's tokens/s appended to `rates`."""
    for _label, threads, engine in runs:  # warm-up
        torch.set_num_threads(threads)
        run_engine(engine, prompts[:2], greedy(4), "warm-up", 2)
    for r in range(ROUNDS):
        for level in levels:
            for label, threads, engine in runs:
                progress(f"round {r + 1}/{ROUNDS}: {label}, {level} concurrent")
                torch.set_num_threads(threads)
                result = run_engine(engine, prompts[:level], greedy(max_tokens), label, level)
                rates.setdefault((label, level), []).append(result.tokens_per_s)


def _engine(args: argparse.Namespace, tp: int, threads: int, eager: bool):
    torch.set_num_threads(threads)
    config = dataclasses.replace(engine_config(args), tensor_parallel_size=tp)
    return create_engine(
        args.model,
        config,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        quantization=quant_config(args),
        threads=threads,
        enforce_eager=eager or args.enforce_eager,
    )


def _print(rates: dict, levels: list[int], labels: list[str], engine, max_tokens: int) -> None:
    print(
        f"\ntensor parallelism: {engine.loaded.name}, {precision_label(engine)}, chat prompts x {max_tokens} new "
        f"tokens (greedy), median of {ROUNDS} alternated rounds, tokens/s"
    )
    width = max(map(len, labels)) + 2
    print(f"{'':<{width}}" + "".join(f"{f'{level} concurrent':>16}" for level in levels))
    for label in labels:
        cells = "".join(f"{median(rates[label, level]):>16.1f}" for level in levels)
        print(f"{label:<{width}}{cells}")
    for label in labels[1:]:  # one process's runs come from both phases: their medians over all
        ratios = ", ".join(
            f"{median(rates[label, lv]) / median(rates[labels[0], lv]):.2f}x at {lv} concurrent" for lv in levels
        )
        print(f"{label} vs {labels[0]}: {ratios}")
    print(machine_line())
