#!/usr/bin/env bash
# Tunes the Triton decode kernel's split on a GPU: the kernel sweep (scripts/gpu_attention_sweep.py), then
# `bench compile --device cuda` (eager / sdpa graphs / graphs) with the sweep's best setting, then the kernel tests.
# Usage (GPU machine, .whl/ as for gpu_check.sh): bash scripts/gpu_triton_tune.sh  (writes to $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD/backend:$PWD/tests:/tmp/site" PYTHONUNBUFFERED=1 MINIVLLM_CACHE_DIR=/tmp/mc
timeout 120 python3 scripts/gpu_attention_sweep.py | tee $OUT/sweep.log
read -r _ MINP PERSM < <(grep ^BEST $OUT/sweep.log)
echo "benches with MIN_PARTITION_TOKENS=$MINP PROGRAMS_PER_SM=$PERSM"
b() { tag=$1; shift; MINIVLLM_CUDA_COMPILE=0 timeout 120 python3 -c "import sys; import minivllm.model.triton_attention as ta; ta.MIN_PARTITION_TOKENS=$MINP; ta.PROGRAMS_PER_SM=$PERSM; from minivllm.cli import main; sys.exit(main(sys.argv[1:]))" bench compile --device cuda --concurrency 1 8 32 --max-tokens 128 --max-num-seqs 32 --max-model-len 2048 --output-dir $OUT/bench-$tag "$@" 2>&1 | grep -v "round .*/.*:" > $OUT/bench-$tag.log; tail -8 $OUT/bench-$tag.log; }
b tinyllama-bf16 --model random:tinyllama-1.1b --dtype bfloat16
b smollm2 --model random:smollm2-135m
timeout 90 python3 -m pytest tests/test_triton_attention.py -q -p no:cacheprovider 2>&1 | tail -2
