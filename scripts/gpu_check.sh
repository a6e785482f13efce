#!/usr/bin/env bash
# The CUDA path's check on a GPU machine, in one short run: the CUDA tests (fp32 parity with
# transformers, CUDA graphs vs eager), then `bench compile` (graphs vs eager decode, side by side) on
# random weights of the embedded model's shape and of TinyLlama-1.1B's. Runs under the machine's own
# python3 and torch; packages it lacks come as wheels in .whl/ (msgspec, gguf, llguidance).
# Usage: scripts/gpu_check.sh [output folder]   (default: $OUT, else ./gpu-check); everything it writes
# also lands in one archive there, gpu-check.tgz (the device tool brings back at most 8 files).
set -u
dest="${1:-${OUT:-gpu-check}}"
out=/tmp/gpu-check
rm -rf "$out" && mkdir -p "$out" "$dest"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD/backend:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MINIVLLM_CACHE_DIR="${MINIVLLM_CACHE_DIR:-/tmp/minivllm-cache}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

timeout 240 python3 -m pytest tests/test_cuda.py tests/test_decode_graphs.py \
    "tests/test_quant.py::test_cuda_kernels_match_the_dequantized_weight" -q -rs -p no:cacheprovider 2>&1 \
    | tee "$out/pytest.log" | tail -25

bench() {  # model, tag, more bench arguments
    local model="$1" tag="$2"
    shift 2
    timeout 150 python3 -c "import sys; from minivllm.cli import main; sys.exit(main(sys.argv[1:]))" \
        bench compile --model "$model" --device cuda --concurrency 1 8 32 --max-tokens 128 \
        --max-num-seqs 32 --max-model-len 2048 --output-dir "$out/bench-$tag" "$@" 2>&1 \
        | grep -v "round .*/.*:" | tee "$out/bench-$tag.log" | tail -7
}
bench random:smollm2-135m smollm2
bench random:tinyllama-1.1b tinyllama
bench random:tinyllama-1.1b tinyllama-bf16 --dtype bfloat16
bench random:tinyllama-1.1b tinyllama-int4 --dtype bfloat16 --quantization int4

# where a step's time goes, graphs and eager (replay alone, runner call, engine step)
timeout 120 python3 scripts/gpu_step_times.py random:smollm2-135m float32 none 2>&1 | grep -v "^\[minivllm\]" | tee "$out/step-times.log"
tar czf "$dest/gpu-check.tgz" -C /tmp gpu-check
