"""The model and engine options shared by every command that builds an engine (generate, chat,
serve, bench), and `build_engine(args)`: vLLM's EngineArgs, for argparse."""

from __future__ import annotations

import argparse
import os

from minivllm.engine.config import KV_CACHE_DTYPES, EngineConfig
from minivllm.quant.policy import INT4_GROUP_SIZES, QUANTIZATION_CHOICES, QuantConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file, cached hub id or random:<shape> (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_CHOICES),
        help="weight precision: auto (what the checkpoint holds: the embedded Q4_1 GGUF runs in 4 bits), "
        "none (dequantized to --dtype), int8 (per channel), int4 (groups, see --group-size)",
    )
    g.add_argument(
        "--group-size",
        type=int,
        default=32,
        choices=list(INT4_GROUP_SIZES),
        help="int4 group size when quantizing at load",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for random:<shape> weights")
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice; 1 avoids thrashing on a busy machine)",
    )
    e = p.add_argument_group("engine")
    e.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no torch.compile of decode steps (which needs a C++ compiler "
        "and compiles for seconds at start-up, cached under $MINIVLLM_CACHE_DIR or ~/.cache/minivllm)",
    )
    e.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over N ranks (processes; gloo on CPU, NCCL on CUDA); started here, or joined "
        "under torchrun across machines. --threads is then per rank (default 1)",
    )
    e.add_argument("--kv-cache-memory", default="512MiB", help="KV pool size, e.g. 2GiB (ignored with --num-blocks)")
    e.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the KV pool's element type: auto (the model's dtype; float16 for quantized weights on a CPU) or "
        "another (float16, bfloat16: "
        "twice the tokens in the same memory, half the bytes decode attention reads; int8, fp8_e4m3: "
        "8 bits a value with a scale per token and head, ~1.9x float16's tokens)",
    )
    e.add_argument(
        "--kv-offload-dir",
        default=None,
        help="keep evicted prefix-cache blocks in this directory and read them back on a prefix hit, "
        "across restarts too (default: RAM only)",
    )
    e.add_argument("--kv-offload-size", default="4GiB", help="the most --kv-offload-dir keeps, e.g. 20GiB (LRU)")
    e.add_argument(
        "--kv-window",
        type=int,
        default=None,
        help="StreamingLLM: keep each sequence's first --kv-sinks tokens and its last ~N tokens in the KV cache "
        "(memory stays flat however long a conversation runs; requests may exceed --max-model-len). Default: off",
    )
    e.add_argument("--kv-sinks", type=int, default=4, help="attention-sink tokens kept with --kv-window (default 4)")
    e.add_argument("--num-blocks", type=int, default=None)
    e.add_argument(
        "--max-kv-cache-memory",
        default=None,
        help="the largest KV pool the dashboard's engine settings may ask for, e.g. 4GiB "
        "(default: what the machine has available)",
    )
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="run each prompt whole in one step (it must fit --max-num-batched-tokens with its max_tokens)",
    )
    e.add_argument(
        "--static-batching",
        action="store_true",
        help="no continuous batching: a new batch starts only once the running one has finished",
    )
    e.add_argument(
        "--recompute-kv", action="store_true", help="no KV cache across steps: recompute the whole context each step"
    )
    e.add_argument("--max-stop-strings", type=int, default=64, help="the most stop strings one request may send")
    e.add_argument("--max-stop-chars", type=int, default=4096, help="their total length at most")
    e.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\', '
        '\'{"method": "draft_model", "model": "embedded", "quantization": "int4"}\' or '
        '\'{"method": "early_exit", "exit_layer": 8}\' (default: off)',
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not getattr(args, "no_chunked_prefill", False),
        static_batching=getattr(args, "static_batching", False),
        recompute_kv=getattr(args, "recompute_kv", False),
        max_kv_cache_memory=getattr(args, "max_kv_cache_memory", None),
        max_stop_strings=args.max_stop_strings,
        max_stop_chars=args.max_stop_chars,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        kv_offload_dir=getattr(args, "kv_offload_dir", None),
        kv_offload_size=getattr(args, "kv_offload_size", "4GiB"),
        kv_window=getattr(args, "kv_window", None),
        kv_sinks=getattr(args, "kv_sinks", 4),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
    )


def quant_config(args: argparse.Namespace) -> QuantConfig:
    return QuantConfig(args.quantization, args.group_size, os.environ.get("MINIVLLM_QUANT_KERNEL") or None)


def build_engine(args: argparse.Namespace):
    """The engine the parsed options describe (loads the model: seconds to minutes)."""
    from minivllm.engine.factory import create_engine

    return create_engine(
        args.model,
        engine_config(args),
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        quantization=quant_config(args),
        threads=args.threads,
        speculative_config=getattr(args, "speculative_config", None),
        enforce_eager=getattr(args, "enforce_eager", False),
    )
