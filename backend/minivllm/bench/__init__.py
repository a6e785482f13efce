"""Benchmarks that print their comparisons side by side in one run (ratios and medians: these
machines are noisy) and write a plot plus the raw numbers as JSON."""

from __future__ import annotations


def run_bench(args) -> int:
    from minivllm.cli import build_engine

    engine = build_engine(args)
    if args.kind == "single":
        from minivllm.bench.single import bench_single

        return bench_single(engine, args)
    if args.kind == "profile":
        from minivllm.bench.profile import bench_profile

        return bench_profile(engine, args)
    from minivllm.bench.throughput import bench_throughput

    return bench_throughput(engine, args)
