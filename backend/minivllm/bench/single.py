"""`minivllm bench single`: single-stream greedy decode speed, this engine vs HF `generate`."""

from __future__ import annotations

from pathlib import Path

from minivllm.bench.common import (
    chat_prompt_ids,
    combine_runs,
    greedy,
    hf_generate,
    load_hf_oracle,
    median,
    precision_label,
    progress,
    run_engine,
)
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.bench.report import plot_throughput, print_table, save_json


def bench_single(engine, args) -> int:
    """Prompt by prompt, this engine, the same engine on fp32 weights (when this one is quantized),
    then HF: on a noisy machine a slow spell hits every side, so the per-prompt ratios (and their
    median) stay meaningful."""
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    count = 2 if args.quick else 5
    max_tokens = 16 if args.quick else args.max_tokens
    prompts = chat_prompt_ids(engine.tokenizer, CHAT_PROMPTS[:count])
    params = greedy(max_tokens)
    contenders = {f"mini-vllm {precision_label(engine)}": _engine_runner(engine, params)}
    if engine.info().quantization != "none" and not args.skip_fp32:
        fp32 = _fp32_engine(engine, args)
        contenders["mini-vllm float32"] = _engine_runner(fp32, params)
    hf = None if args.skip_hf else load_hf_oracle(engine.loaded)
    if hf is not None:
        contenders["HF generate sequential"] = lambda p: hf_generate(hf, engine.tokenizer, [p], max_tokens, "seq", 1)
    progress("warm-up")
    for run in contenders.values():
        run(prompts[0])
    runs: dict[str, list] = {name: [] for name in contenders}
    for i, prompt in enumerate(prompts):
        progress(f"prompt {i + 1}/{count}: {max_tokens} tokens with each of {', '.join(contenders)}")
        for name, run in contenders.items():
            runs[name].append(run(prompt))
    results = [combine_runs(name, 1, rs) for name, rs in runs.items()]
    print_table(
        results, f"single-stream greedy decode, {engine.loaded.name}, {count} chat prompts x {max_tokens} tokens"
    )
    print(machine_line())
    first = next(iter(runs))
    for other in list(runs)[1:]:
        ratios = [a.tokens_per_s / b.tokens_per_s for a, b in zip(runs[first], runs[other])]
        print(
            f"speed-up vs {other}: {results[0].tokens_per_s / results[list(runs).index(other)].tokens_per_s:.2f}x "
            f"tokens/s overall; per prompt {' '.join(f'{r:.2f}x' for r in ratios)} (median {median(ratios):.2f}x)"
        )
    save_json(results, out_dir / "single.json")
    plot = plot_throughput(results, out_dir / "single.png", "single-stream greedy decode")
    print(f"plot: {plot}")
    return 0


def _engine_runner(engine, params):
    return lambda prompt: run_engine(engine, [prompt], params, "seq", 1)


def _fp32_engine(engine, args):
    """The same model and engine settings on weights dequantized to fp32: the baseline quantization
    has to beat."""
    from minivllm.engine.factory import engine_for
    from minivllm.loader import load_model

    progress("loading the fp32 baseline (--quantization none)")
    loaded = load_model(
        args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        quantization="none",
    )
    return engine_for(loaded, engine.config)
