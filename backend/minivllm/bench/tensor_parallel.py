"""`minivllm bench throughput --tensor-parallel-size N`: the model split over N ranks of T threads against
one process of N x T threads, on the same prompts, alternated round by round (this box is shared and noisy:
medians and ratios). One process runs twice: its default decode path (the native step on a CPU) and eagerly,
the path tensor-parallel ranks take (model/tensor_parallel.py), so the split's own cost shows apart."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from minivllm.bench.common import chat_prompt_ids, greedy, median, precision_label, progress, run_engine
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.engine.factory import create_engine
from minivllm.engine_args import engine_config, quant_config

ROUNDS = 3


def bench_tp(args: argparse.Namespace) -> int:
    n, per_rank = args.tensor_parallel_size, args.threads or 1
    whole = n * per_rank
    runs = [  # (label, threads while it runs, engine)
        (f"TP=1, {whole} threads", whole, _engine(args, 1, whole, eager=False)),
        (f"TP=1 eager, {whole} threads", whole, _engine(args, 1, whole, eager=True)),
        (f"TP={n}, {per_rank} thread(s) a rank", per_rank, _engine(args, n, per_rank, eager=False)),
    ]
    first = runs[0][2]
    levels = sorted({1, max(args.concurrency)})
    max_tokens = 16 if args.quick else args.max_tokens
    prompts = chat_prompt_ids(first.tokenizer, (CHAT_PROMPTS * 4)[: max(levels)])
    rates: dict[tuple[str, int], list[float]] = {}
    try:
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
    finally:
        runs[-1][2].close()  # the workers exit
    torch.set_num_threads(whole)
    _print(rates, levels, [label for label, _, _ in runs], first, max_tokens)
    return 0


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
    print(f"{'':<32}" + "".join(f"{f'{level} concurrent':>16}" for level in levels))
    for label in labels:
        cells = "".join(f"{median(rates[label, level]):>16.1f}" for level in levels)
        print(f"{label:<32}{cells}")
    base, eager = labels[0], labels[1]
    for label in labels[1:]:
        for reference in {base, eager} - {label}:
            ratios = ", ".join(
                f"{median(rates[label, lv]) / median(rates[reference, lv]):.2f}x at {lv} concurrent" for lv in levels
            )
            print(f"{label} vs {reference}: {ratios}")
    print(machine_line())
