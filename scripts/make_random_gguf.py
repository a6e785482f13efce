#!/usr/bin/env python
"""Writes a Llama (or Qwen2) GGUF of a named public shape with random weights and the embedded tokenizer, quantized by
llama.cpp's own `llama-quantize`, once into .cache/models/, and prints its path (progress goes to stderr).
A MODEL that is already a file is printed back, so `make bench-llamacpp MODEL=...` takes either.

    python scripts/make_random_gguf.py tinyllama-1.1b --quant Q4_K_M
    python scripts/make_random_gguf.py llama-3.2-3b --quant Q8_0
    python scripts/make_random_gguf.py qwen2.5-1.5b --quant Q4_K_M   # GGUF arch qwen2, Q/K/V biases
"""

import argparse
from pathlib import Path

from minivllm.bench.random_gguf import SHAPES, quantized

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help=f"a shape ({', '.join(SHAPES)}) or a GGUF file (printed back)")
    parser.add_argument("--quant", default="Q4_K_M", help="a llama-quantize type: Q4_K_M, Q8_0, Q4_0, ... or F16")
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "models")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if Path(args.model).is_file():
        print(args.model)
        return
    if args.model not in SHAPES:
        parser.error(f"{args.model!r} is neither a file nor one of the shapes {', '.join(SHAPES)}")
    print(quantized(args.model, args.quant, args.cache, args.seed))


if __name__ == "__main__":
    main()
