"""Benchmarks that print their comparisons side by side in one run (ratios and medians: these
machines are noisy) and write a plot plus the raw numbers as JSON."""

from __future__ import annotations


def run_bench(args) -> int:
    from minivllm.engine_args import build_engine

    if args.kind == "ablation":  # builds an engine per configuration, each in a process of its own
        from minivllm.bench.ablation import bench_ablation

        return bench_ablation(args)
    if args.max_tokens is None:
        args.max_tokens = 64 if args.kind == "serve" else 128
    if args.kind == "quality":  # loads the model once per precision itself
        from minivllm.bench.quality import bench_quality

        return bench_quality(args)
    if args.kind == "llamacpp":
        from minivllm.bench.llamacpp import bench_llamacpp, find_llamacpp_bench

        find_llamacpp_bench()  # fail before loading the model when llama.cpp is not built
        return bench_llamacpp(build_engine(args), args)
    if args.kind == "throughput" and getattr(args, "tensor_parallel_size", 1) > 1:  # N ranks against 1 process
        from minivllm.bench.tensor_parallel import bench_tp

        return bench_tp(args)
    engine = build_engine(args)
    if args.kind == "single":
        from minivllm.bench.single import bench_single

        return bench_single(engine, args)
    if args.kind == "profile":
        from minivllm.bench.profile import bench_profile

        return bench_profile(engine, args)
    if args.kind == "spec":
        from minivllm.bench.spec import bench_spec

        return bench_spec(engine, args)
    if args.kind == "compile":
        from minivllm.bench.compiled import bench_compile

        return bench_compile(engine, args)
    if args.kind == "pages":
        from minivllm.bench.pages import bench_pages

        return bench_pages(engine, args)
    if args.kind == "sampler":
        from minivllm.bench.sampler import bench_sampler

        return bench_sampler(engine, args)
    if args.kind == "structured":
        from minivllm.bench.structured import bench_structured

        return bench_structured(engine, args)
    if args.kind == "kv":
        from minivllm.bench.kv_tiers import bench_kv

        return bench_kv(engine, args)
    if args.kind == "serve":
        from minivllm.bench.serve import bench_serve

        return bench_serve(engine, args)
    from minivllm.bench.throughput import bench_throughput

    return bench_throughput(engine, args)
