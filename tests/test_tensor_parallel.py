"""Tensor parallelism on 2 CPU ranks over gloo, one thread each (engine/tp_workers.py,
model/tensor_parallel.py): the split model against the whole one on a tiny random Llama."""

from __future__ import annotations

import multiprocessing
import re
import subprocess
import sys

import pytest
import torch
from tiny_models import make_tiny_llama

from minivllm.core.step_work import SeqWork
from minivllm.engine.config import EngineConfig
from minivllm.engine.factory import create_engine
from minivllm.errors import ConfigError
from minivllm.kernels.cpu import native
from minivllm.model import tensor_parallel
from minivllm.quant.formats import KQUANT_BYTES, KQuantWeight, quantize_int4, quantize_int8
from minivllm.quant.policy import QuantConfig
from minivllm.sampling.params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 128, 9, 33, 71], [200, 1, 14, 88, 150, 6]]
CONFIG = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """4 heads of 32 / 2 KV heads, intermediate 128: every split by 2 divides, and each rank's products take
    inputs in whole pairs of 32-weight blocks (our 4-bit kernel's step, so the native step serves them)."""
    directory = tmp_path_factory.mktemp("tp-llama")
    make_tiny_llama(directory, seed=3, intermediate=128, init_std=0.08, head_dim=32)
    return str(directory)


def engine(model: str, tp: int, **kwargs):
    """Not eager (the tests' default): each rank takes the native decode step where it can."""
    return create_engine(model, CONFIG, threads=1, tensor_parallel_size=tp, enforce_eager=False, **kwargs)


def greedy(eng, max_tokens: int = 32) -> list[list[int]]:
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(str(i), params=params, prompt_token_ids=prompt)
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    assert all(len(t) == max_tokens for t in tokens.values())
    return list(tokens.values())


def every_logit(eng) -> torch.Tensor:
    """Logits at every position of the first prompt, on a fresh engine's free blocks."""
    prompt = PROMPTS[0]
    return eng.runner.execute([], [SeqWork(prompt, 0, [0], num_logits=len(prompt))])


def run(model: str, tp: int, logits: bool = False, **kwargs):
    eng = engine(model, tp, **kwargs)
    try:
        return (every_logit(eng) if logits else None), greedy(eng), eng
    finally:
        eng.close()


def native_calls(run_engine) -> int:
    """How many native decode steps rank 0 ran inside `run_engine()`, and what it returned."""
    native.decode_part_timing(True)
    native.decode_part_times()  # from zero
    try:
        result = run_engine()
        return native.decode_part_times()[2], result
    finally:
        native.decode_part_timing(False)


@pytest.fixture(autouse=True)
def our_fp32_kernel(monkeypatch):
    """Our fp32 kernel, not MKL, on every rank (spawned ranks inherit the environment): at these tiny shapes the
    timed choice turns on noise (measured 1.6x at 64 rows against a limit of 1.5x), and MKL has no native step."""
    monkeypatch.setenv("MINIVLLM_FP32_KERNEL", "native")


def test_fp32_logits_and_greedy_tokens_match_one_rank(tiny_dir):
    logits1, tokens1, _ = run(tiny_dir, 1, logits=True, quantization="none")
    calls, (logits2, tokens2, eng) = native_calls(lambda: run(tiny_dir, 2, logits=True, quantization="none"))
    assert logits2.shape == logits1.shape == (len(PROMPTS[0]), 256)
    assert (logits2 - logits1).abs().max().item() < 1e-4
    assert tokens2 == tokens1
    # each rank holds half the KV heads; decode steps run natively, summing through shared memory
    assert eng.kv_cache.k[0].shape[2] == 1
    assert calls >= 31 and "all-reduces in shared memory over 2 ranks" in eng.info().compilation
    assert eng.loaded.model.tp.shm is not None


def test_without_shared_memory_the_ranks_sum_over_gloo_and_decode_eagerly(tiny_dir, monkeypatch):
    monkeypatch.setattr(tensor_parallel, "create_segment", lambda world: None)
    _, tokens1, _ = run(tiny_dir, 1, quantization="none")
    calls, (_, tokens2, eng) = native_calls(lambda: run(tiny_dir, 2, quantization="none"))
    assert tokens2 == tokens1
    assert calls == 0 and eng.loaded.model.tp.shm is None
    assert "tensor parallelism over 2 ranks without shared memory" in eng.info().compilation


def test_close_leaves_no_live_child(tiny_dir):
    eng = engine(tiny_dir, 2, quantization="none")
    workers = list(eng.loaded.model.tp.processes)
    assert len(workers) == 1 and workers[0].is_alive()
    eng.close()
    eng.close()  # twice is harmless
    assert not workers[0].is_alive() and workers[0].exitcode == 0
    assert multiprocessing.active_children() == []


def test_int4_matches_one_rank_in_the_same_format(tiny_dir):
    """Kernels forced to fp32 activations on both: the chooser times each shape, and a rank's halves may
    otherwise pick a kernel of other arithmetic (bf16 activations) than the whole layer did."""
    int4 = QuantConfig("int4", kernel="fp32")
    _, tokens1, _ = run(tiny_dir, 1, quantization=int4)
    calls, (_, tokens2, eng) = native_calls(lambda: run(tiny_dir, 2, quantization=int4))
    assert tokens2 == tokens1
    assert "int4" in eng.loaded.quant.mode and calls > 0  # the 4-bit kernels inside the native step


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
        {"method": "early_exit", "exit_layer": 1, "num_speculative_tokens": 2, "adaptive": False},
    ],
    ids=["ngram", "early_exit"],
)
def test_speculation_matches_one_rank_without_drafts(tiny_dir, spec):
    """Rank 0 proposes; verify steps (and an early exit's draft rounds) are runner calls the workers replay."""
    _, plain, _ = run(tiny_dir, 1, quantization="none")
    _, tokens, eng = run(tiny_dir, 2, quantization="none", speculative_config=spec)
    assert tokens == plain
    assert eng.speculator is not None and eng.telemetry.counters.spec_draft_tokens > 0


def test_a_split_that_does_not_divide_is_refused_with_its_numbers(tiny_dir):
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 must divide .*attention heads \(4\)"):
        engine(tiny_dir, 3, quantization="none")
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_the_embedded_gguf_splits_three_ways_in_its_own_blocks_not_two():
    """SmolLM2-135M: 9 heads / 3 KV heads. Q4_1 layers and the Q8_0 embedding sliced in their stored blocks
    (o_proj's 576 inputs / 3 = 192, down's 1536 / 3 = 512: whole 32-weight blocks), token-identical to one rank."""
    with pytest.raises(ConfigError, match=r"attention heads \(9\), KV heads \(3\); sizes that split .*: 1, 3"):
        create_engine(None, CONFIG, threads=1, tensor_parallel_size=2)
    auto = QuantConfig("auto", kernel="fp32")
    _, tokens1, _ = run(None, 1, quantization=auto)
    _, tokens3, eng = run(None, 3, quantization=auto)
    assert tokens3 == tokens1
    assert "int4" in eng.loaded.quant.mode and eng.kv_cache.k[0].shape[2] == 1


@pytest.mark.slow
def test_torchrun_ranks_join_the_rendezvous_and_generate_what_one_process_does():
    """Two processes started by torchrun (env:// rendezvous, as across machines): rank 0 generates, rank 1
    serves its steps and exits cleanly once rank 0 is done."""
    args = ["generate", "Hello there", "--model", "random:tiny", "--max-tokens", "8", "--enforce-eager"]
    one = subprocess.run([sys.executable, "-m", "minivllm", *args], capture_output=True, text=True, timeout=300)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    split = subprocess.run(
        [*torchrun, "-m", "minivllm", *args, "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=300
    )
    assert one.returncode == 0 and split.returncode == 0, split.stderr[-2000:]
    assert one.stdout.strip() and split.stdout == one.stdout
    assert "tensor parallelism: 2 ranks over gloo" in split.stderr


def test_quantized_slices_keep_their_stored_values():
    """Input columns cut at block boundaries stay in their format with the same values; a cut inside a block
    falls back to floats; rows of a K-quant weight of two parts (a fused q|k|v) span both."""
    torch.manual_seed(0)
    w = torch.randn(8, 512)
    kquant = KQuantWeight([(kind, _super_blocks(4, 2, kind)) for kind in ("Q4_K", "Q6_K")])
    for weight in (quantize_int4("w", w, 32), quantize_int8("w", w, 32), quantize_int8("w", w), kquant):
        part = tensor_parallel._columns("w", weight, 256, 512, torch.float32)
        assert type(part) is type(weight)
        torch.testing.assert_close(part.dequantize(), weight.dequantize()[:, 256:], rtol=0, atol=0, equal_nan=True)
    cut = tensor_parallel._columns("w", quantize_int4("w", w, 32), 16, 48, torch.float32)
    assert isinstance(cut, torch.Tensor) and torch.equal(cut, quantize_int4("w", w, 32).dequantize()[:, 16:48])
    rows = tensor_parallel._rows(kquant, 2, 6)
    assert rows.kinds == ["Q4_K", "Q6_K"]
    torch.testing.assert_close(rows.dequantize(), kquant.dequantize()[2:6], rtol=0, atol=0, equal_nan=True)


def _super_blocks(rows: int, per_row: int, kind: str) -> torch.Tensor:
    """Random bytes as K-quant rows (any bytes decode; a NaN scale decodes to NaNs, compared as equal)."""
    return torch.randint(0, 256, (rows, per_row * KQUANT_BYTES[kind]), dtype=torch.uint8)


@pytest.mark.slow
def test_the_bench_prints_the_split_over_shared_memory_and_over_gloo_beside_one_process():
    args = ["bench", "throughput", "--model", "random:tiny", "--tensor-parallel-size", "2", "--quick"]
    done = subprocess.run([sys.executable, "-m", "minivllm", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for label in ("TP=1, 2 threads", "TP=2 over shared memory, 1 thread(s) a rank", "TP=2 over gloo"):
        assert re.search(rf"^{re.escape(label)}.*\s\d+\.\d\s+\d+\.\d$", done.stdout, re.M), (label, done.stdout)
    assert "TP=2 over gloo, 1 thread(s) a rank vs TP=1, 2 threads: " in done.stdout
    assert "machine: CPU capability" in done.stdout
