"""`minivllm bench quality`: what each weight precision (and a narrower KV cache) costs in quality,
against fp32.

For each precision: perplexity on a fixed English text (the US Declaration of Independence, public
domain, shipped in bench/data/), the KL divergence KL(fp32 || quantized) of the next-token
distributions at every position of that text and the top-1 agreement (as llama.cpp's
`--kl-divergence` reports them), and greedy agreement over 64 tokens on the chat prompts. The fp32
reference is the checkpoint dequantized (`--quantization none`): for the embedded GGUF that is
exactly what HF's reader gives the parity tests. The text runs CHUNK tokens a step, so all but the
first chunk of a window read their prefix's K/V from the pool, as serving does: the rows with a
float16 (the default for quantized weights on a CPU) / bfloat16 KV cache (`--kv-cache-dtype`) measure
what rounding K/V costs, to be read against the `auto` row with an fp32 pool (every weight row has one);
the int8 / fp8_e4m3 rows (8 bits and a scale per token and head) likewise, and one int8 row on fp32 weights,
whose KL against the reference is the pool's alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from minivllm.bench.common import chat_prompt_ids, greedy, progress
from minivllm.bench.machine import machine_line
from minivllm.bench.prompts import CHAT_PROMPTS
from minivllm.engine.api import EngineConfig, OutputAccumulator, QuantConfig
from minivllm.engine.factory import engine_for
from minivllm.engine.scoring import forward_in_chunks

TEXT_FILE = "declaration_of_independence.txt"
WINDOW = 256  # tokens per scored window (each window is an independent sequence)
GREEDY_TOKENS = 64
CHUNK = 32  # tokens of a window a step: all but the first chunk attend to K/V read from the pool


@dataclass
class QualityRow:
    precision: str
    weights_mib: float
    weight_ratio: float
    perplexity: float
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    greedy_identical: int  # prompts whose 64 greedy tokens equal fp32's
    greedy_prompts: int
    greedy_matching_prefix: float  # mean tokens before the first difference
    kv_cache_dtype: str = "auto"


def precisions(group_sizes=(32, 64)) -> list[tuple[str, QuantConfig, str]]:
    """(label, weights, KV cache dtype) per row; the first is the reference."""
    rows = [
        ("fp32 (none)", QuantConfig("none")),
        ("auto, float32 KV cache", QuantConfig("auto")),
        ("auto, fast kernels (int8 activations)", QuantConfig("auto", kernel="fast")),
        ("auto, torch's kernels (bf16 activations)", QuantConfig("auto", kernel="bf16")),
        ("auto, exact kernels (fp32 activations)", QuantConfig("auto", kernel="exact")),
        ("int8 per channel", QuantConfig("int8")),
    ]
    rows += [(f"int4 g{g}", QuantConfig("int4", group_size=g)) for g in group_sizes]
    kv_rows = [
        ("auto, float16 KV cache (CPU default)", QuantConfig("auto"), "float16"),
        ("auto, bfloat16 KV cache", QuantConfig("auto"), "bfloat16"),
        ("auto, int8 KV cache", QuantConfig("auto"), "int8"),
        ("auto, fp8_e4m3 KV cache", QuantConfig("auto"), "fp8_e4m3"),
        ("fp32, int8 KV cache (the pool's cost alone)", QuantConfig("none"), "int8"),
    ]
    # the weight rows on an fp32 pool: each measures its weights alone; the KV rows add the pool's rounding
    return [(label, quant, "float32") for label, quant in rows] + kv_rows


def bench_quality(args) -> int:
    from minivllm.loader import load_model

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = resources.files("minivllm.bench").joinpath("data", TEXT_FILE).read_text()
    reference = None
    rows = []
    for label, quant, kv_cache_dtype in precisions():
        progress(f"loading {label}")
        loaded = load_model(args.model, dtype=args.dtype, device=args.device, seed=args.seed, quantization=quant)
        windows = _windows(loaded.tokenizer.encode(text), 2 if args.quick else 8)
        prompts = chat_prompt_ids(loaded.tokenizer, CHAT_PROMPTS[: 2 if args.quick else 5])
        progress(f"scoring {label}: {len(windows)} windows of {WINDOW} tokens, {len(prompts)} greedy prompts")
        result = _score(loaded, windows, prompts, GREEDY_TOKENS // (4 if args.quick else 1), kv_cache_dtype)
        reference = reference or result
        rows.append(_row(label, loaded.quant, result, reference, kv_cache_dtype))
        del loaded
    _print(rows, args)
    (out_dir / "quality.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print(f"plot: {_plot(rows, out_dir / 'quality.png')}")
    return 0


def _windows(ids: list[int], count: int) -> list[list[int]]:
    return [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)][:count]


@dataclass
class _Scored:
    log_probs: torch.Tensor  # [positions, vocab] next-token log-distributions over all windows
    nll: float
    greedy: list[list[int]]


def _score(loaded, windows, prompts, max_tokens, kv_cache_dtype: str) -> _Scored:
    from minivllm.engine.config import KV_CACHE_DTYPES

    logits = forward_in_chunks(loaded, windows, CHUNK, KV_CACHE_DTYPES[kv_cache_dtype])
    log_probs = torch.cat([lg[:-1] for lg in logits]).log_softmax(-1)
    targets = torch.tensor([t for w in windows for t in w[1:]])
    nll = -log_probs.gather(1, targets[:, None]).mean().item()
    return _Scored(log_probs, nll, _greedy(loaded, prompts, max_tokens, kv_cache_dtype))


def _greedy(loaded, prompts, max_tokens, kv_cache_dtype: str) -> list[list[int]]:
    engine = engine_for(loaded, EngineConfig(num_blocks=256, kv_cache_dtype=kv_cache_dtype))
    outs, whole = {}, OutputAccumulator()
    params = greedy(max_tokens)  # ignore_eos: every prompt compares the same 64 tokens
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", prompt_token_ids=p, params=params)
    while engine.has_work():
        for out in map(whole.add, engine.step()):
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return [outs[f"q{i}"] for i in range(len(prompts))]


def _row(label: str, report, result: _Scored, ref: _Scored, kv_cache_dtype: str) -> QualityRow:
    kl = _kl_per_position(ref.log_probs, result.log_probs)
    top1 = (ref.log_probs.argmax(-1) == result.log_probs.argmax(-1)).float().mean().item()
    prefixes = [_common_prefix(a, b) for a, b in zip(result.greedy, ref.greedy)]
    identical = sum(a == b for a, b in zip(result.greedy, ref.greedy))
    return QualityRow(
        label,
        report.weight_bytes / 2**20,
        report.ratio,
        math.exp(result.nll),
        kl.mean().item(),
        kl.quantile(0.99).item(),
        top1,
        identical,
        len(ref.greedy),
        sum(prefixes) / len(prefixes),
        kv_cache_dtype,
    )


def _kl_per_position(ref: torch.Tensor, other: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """KL(ref || other) per position, in float64 a chunk of rows at a time: in fp32 the log-softmax's rounding
    (~1e-7, a shift of the whole row) outweighs the KL of a nearly exact precision (~1e-8) and can turn it
    negative. The fp32 log-probabilities are renormalised in float64 first, so that shift cancels."""
    parts = []
    for start in range(0, ref.shape[0], rows):
        p = ref[start : start + rows].double().log_softmax(-1)
        q = other[start : start + rows].double().log_softmax(-1)
        parts.append((p.exp() * (p - q)).sum(-1))
    return torch.cat(parts)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _print(rows: list[QualityRow], args) -> None:
    print(
        f"\n== quality by weight precision: {args.model or 'embedded SmolLM2-135M-Instruct'} "
        f"(reference: fp32; text: US Declaration of Independence, {WINDOW}-token windows) =="
    )
    head = (
        f"{'precision':<42} {'weights':>9} {'of fp32':>7} {'PPL':>7} {'KL mean':>8} {'KL p99':>8} "
        f"{'top-1':>6} {'greedy =':>8} {'prefix':>6}"
    )
    print(machine_line())
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.precision:<42} {r.weights_mib:>6.0f}MiB {r.weight_ratio:>7.0%} {r.perplexity:>7.3f} "
            f"{r.kl_mean:>8.5f} {r.kl_p99:>8.4f} {r.top1_agreement:>6.1%} "
            f"{r.greedy_identical:>4}/{r.greedy_prompts:<3} {r.greedy_matching_prefix:>6.1f}"
        )


def _plot(rows: list[QualityRow], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    labels = [r.precision.replace(" (", "\n(") for r in rows]
    for ax, values, title in (
        (axes[0], [r.weights_mib for r in rows], "weights (MiB)"),
        (axes[1], [r.kl_mean for r in rows], "KL(fp32 || precision), mean"),
        (axes[2], [r.top1_agreement * 100 for r in rows], "top-1 agreement with fp32 (%)"),
    ):
        ax.barh(labels, values, color="#4c78a8")
        ax.set_title(title, fontsize=10)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
