#!/usr/bin/env bash
# The CUDA path's check on a GPU machine, in one short run: `bench compile` with
# MINIVLLM_CUDA_COMPILE=1 (CUDA graphs of the compiled layers vs graphs of eager kernels vs the same
# graphs with gather + SDPA decode attention instead of the Triton kernel vs eager decode, side by
# side) on random weights of the embedded model's shape (and of TinyLlama-1.1B's), the CUDA tests
# (fp32 parity with transformers, graphs vs eager, the Triton decode kernel against the gathered
# path), and where a step's time goes. Runs under the machine's own python3 and torch;
# packages it lacks come as wheels in .whl/ (msgspec, gguf, llguidance).
# Usage: [BENCHES="smollm2 tinyllama tinyllama-bf16 tinyllama-int4"] [CUDA_COMPILE=0] scripts/gpu_check.sh [output folder]
# (CUDA_COMPILE=0: the benches leave out the compiled-layer graphs, and their cold compile)
# (default folder: $OUT, else ./gpu-check). Each part has its own time limit, most important first.
set -u
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD/backend:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MINIVLLM_CACHE_DIR="${MINIVLLM_CACHE_DIR:-/tmp/minivllm-cache}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

bench() {  # tag, seconds, model, more bench arguments
    local tag="$1" limit="$2" model="$3"
    shift 3
    MINIVLLM_CUDA_COMPILE="${CUDA_COMPILE:-1}" timeout "$limit" python3 -c "import sys; from minivllm.cli import main; sys.exit(main(sys.argv[1:]))" \
        bench compile --model "$model" --device cuda --concurrency 1 8 32 --max-tokens 128 \
        --max-num-seqs 32 --max-model-len 2048 --output-dir "$out/bench-$tag" "$@" 2>&1 \
        | grep -v "round .*/.*:" | tee "$out/bench-$tag.log" | grep -v "^\[minivllm\] *capturing" | tail -9
}
timeout 170 python3 -m pytest tests/test_cuda.py tests/test_triton_attention.py tests/test_decode_graphs.py \
    "tests/test_quant.py::test_cuda_kernels_match_the_dequantized_weight" -q -rs -p no:cacheprovider 2>&1 \
    | tee "$out/pytest.log" | grep -v "^\[minivllm\]" | tail -12

benches=" ${BENCHES:-smollm2 tinyllama tinyllama-bf16 tinyllama-int4} "
[[ $benches == *" smollm2 "* ]] && bench smollm2 180 random:smollm2-135m


# where a step's time goes (replay alone, runner call with and without graphs, engine step)
timeout 70 python3 scripts/gpu_step_times.py random:smollm2-135m float32 none 2>&1 | grep -v "^\[minivllm\]" \
    | tee "$out/step-times.log"

[[ $benches == *" tinyllama-bf16 "* ]] && bench tinyllama-bf16 90 random:tinyllama-1.1b --dtype bfloat16
[[ $benches == *" tinyllama "* ]] && bench tinyllama 90 random:tinyllama-1.1b
[[ $benches == *" tinyllama-int4 "* ]] && bench tinyllama-int4 90 random:tinyllama-1.1b --dtype bfloat16 --quantization int4
true
