"""The native decode step (model/native_step.py, kernels/cpu/decode_step.cpp): every layer of a decode
step in one C++ call. Against the eager layers on a tiny 4-bit model (every shape, an early exit, the
pool it writes), a row's bits alone and in a batch, the fallback where a kernel plan is not ours, a bad
slot refused before anything is written, and the embedded model's greedy tokens."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys

import pytest
import torch

from engine_utils import (
    EARLY_EXIT,
    NGRAM,
    assert_all_blocks_free,
    chat_ids,
    first_part_at_a_near_tie,
    make_engine,
    random_decode_works,
    run,
    sampling_mix_outputs,
)
from minivllm.core.step_work import SeqWork
from minivllm.engine.config import EngineConfig
from minivllm.engine.factory import create_engine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.kernels.cpu import native
from minivllm.loader import load_model
from minivllm.model.native_products import ABSENT
from minivllm.model.native_step import PIECES, SCALES, WEIGHTS_PER_LAYER, NativeDecodeStep, product_kinds
from minivllm.model.packed_linear import PackedLinear
from minivllm.quant.linear import QuantLinear
from minivllm.quant.matmul_paths import Kernel
from minivllm.quant.policy import QuantConfig
from minivllm.sampling.params import SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig

pytestmark = pytest.mark.skipif(
    not native.cpu_has_avx2(),
    reason=f"CPU capability {torch.backends.cpu.get_cpu_capability()} has no AVX2: no native kernels",
)


@pytest.fixture(scope="module")
def tiny_q4():
    """A tiny model in 4 bits on our kernels (int8x2 activations), its native step, and an engine."""
    loaded = load_model("random:tiny", quantization=QuantConfig("int4", kernel="int8x2"), max_model_len=256)
    step = NativeDecodeStep.for_model(loaded.model)
    assert step is not None and native.available() is None
    engine = make_engine(loaded, max_num_seqs=4, block_size=16, num_blocks=96)
    return loaded, step, engine


@pytest.fixture(scope="module")
def tiny_fp32():
    """A tiny fp32 model with every product on our fp32 kernel (the load's timing may pick MKL on
    another machine; here it is set), its native step, and an engine."""
    loaded = load_model("random:tiny", quantization="none", max_model_len=256)
    for module in loaded.model.modules():
        if isinstance(module, PackedLinear):
            module.native = True
    engine = make_engine(loaded, max_num_seqs=4, block_size=16, num_blocks=96)
    return loaded, NativeDecodeStep.for_model(loaded.model), engine


def _step(loaded, engine, step, works, chunks=(), **kwargs) -> torch.Tensor:
    """A step's logits with this native step (None: eager)."""
    loaded.model.native_step = step
    try:
        return engine.runner.execute(works, list(chunks), **kwargs)
    finally:
        loaded.model.native_step = None


def _assert_near(native_logits: torch.Tensor, eager_logits: torch.Tensor) -> None:
    """Norm, rotary and SiLU round differently from torch's in the last bits, and that can move an
    activation's int8x2 rounding step: differences ~1e-5 of the logits' scale, not an error's ~1."""
    scale = eager_logits.abs().max().item()
    torch.testing.assert_close(native_logits, eager_logits, atol=2e-4 * scale, rtol=0)


@pytest.mark.slow
def test_native_logits_match_the_eager_layers_for_every_decode_shape(tiny_q4, native_calls):
    loaded, step, engine = tiny_q4
    rng = random.Random(0)
    shapes = [1, 2, 3, 4, 1, 4]
    for rows in shapes:
        works = random_decode_works(rng, rows, engine.block_manager.num_blocks, max_width=6)
        eager = _step(loaded, engine, None, works)
        k_eager = [pool.clone() for pool in engine.kv_cache.k]
        native_logits = _step(loaded, engine, step, works)
        assert native_logits.shape == (rows, loaded.config.vocab_size)
        _assert_near(native_logits, eager)
        for layer, pool in enumerate(engine.kv_cache.k):  # the K it wrote: rotated the same way
            torch.testing.assert_close(pool.float(), k_eager[layer].float(), atol=2e-3, rtol=1e-3)
    assert native_calls == shapes


@pytest.fixture
def native_calls(monkeypatch) -> list[int]:
    """The row counts of the native step's calls while a test runs."""
    calls: list[int] = []
    real = torch.ops.minivllm_native.decode_layers

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(torch.ops.minivllm_native, "decode_layers", spy)
    return calls


def test_native_step_runs_when_it_can_and_the_runner_takes_it(tiny_q4, native_calls):
    loaded, step, engine = tiny_q4
    _step(loaded, engine, step, random_decode_works(random.Random(1), 3, engine.block_manager.num_blocks, max_width=6))
    assert native_calls == [3]


def test_an_early_exit_runs_only_its_layers(tiny_q4, native_calls):
    loaded, step, engine = tiny_q4
    works = random_decode_works(random.Random(2), 2, engine.block_manager.num_blocks, max_width=6)
    eager = _step(loaded, engine, None, works, num_layers=1)
    _assert_near(_step(loaded, engine, step, works, num_layers=1), eager)
    assert native_calls == [2]


def test_the_part_clocks_time_each_part_of_a_call_only_while_on(tiny_q4):
    loaded, step, engine = tiny_q4
    works = random_decode_works(random.Random(7), 2, engine.block_manager.num_blocks, max_width=6)
    nothing = ({part: 0.0 for part in native.DECODE_PARTS}, 0.0, 0)
    native.decode_part_times()  # from zero
    _step(loaded, engine, step, works)
    assert native.decode_part_times() == nothing  # off: nothing
    native.decode_part_timing(True)
    try:
        for _ in range(3):
            _step(loaded, engine, step, works)
    finally:
        native.decode_part_timing(False)
    parts, whole, calls = native.decode_part_times()
    assert calls == 3 and list(parts) == list(native.DECODE_PARTS)
    one_rank = parts.pop("all-reduce")
    assert all(seconds > 0 for seconds in parts.values()), parts  # every part ran, in every layer
    assert one_rank == 0  # one rank: nothing to sum over
    assert sum(parts.values()) < whole  # parts of the calls, each timed inside its call
    assert native.decode_part_times() == nothing  # a read restarts


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(tiny_q4):
    loaded, step, engine = tiny_q4
    works = random_decode_works(random.Random(3), 4, engine.block_manager.num_blocks, max_width=6)
    batched = _step(loaded, engine, step, works)
    for i, work in enumerate(works):
        assert torch.equal(_step(loaded, engine, step, [work]), batched[i : i + 1])


def test_a_mixed_step_runs_its_single_rows_natively_with_their_bits_alone(tiny_q4, native_calls):
    """The runner gives a step's single-token rows a pass of their own beside a prefill chunk: they run
    natively, with the same bits as without the chunk, and the chunk's rows are eager's exactly."""
    loaded, step, engine = tiny_q4
    rng = random.Random(7)
    single = random_decode_works(rng, 2, engine.block_manager.num_blocks, max_width=6)
    chunk = SeqWork([rng.randrange(49152) for _ in range(5)], 16, [40, 41], num_logits=5)
    eager = _step(loaded, engine, None, single, [chunk])
    mixed = _step(loaded, engine, step, single, [chunk])
    assert native_calls == [2]
    torch.testing.assert_close(mixed[2:], eager[2:], atol=0, rtol=0)
    assert torch.equal(mixed[:2], _step(loaded, engine, step, single))
    _assert_near(mixed[:2], eager[:2])


@pytest.mark.slow
def test_a_rebuilt_pool_runs_natively(tiny_fp32):
    """The dashboard's settings rebuild the KV pool (another block count and size): the native step
    reads the new pools as they come."""
    loaded, step, engine = tiny_fp32
    try:
        engine.reconfigure(num_blocks=80, block_size=8)
        works = random_decode_works(random.Random(8), 3, 80, block_size=8, max_width=6)
        eager = _step(loaded, engine, None, works)
        torch.testing.assert_close(_step(loaded, engine, step, works), eager, atol=1e-4, rtol=0)
    finally:
        engine.reconfigure(num_blocks=96, block_size=16)


@pytest.mark.slow
def test_engine_outputs_with_beams_and_n_equal_eager_in_fp32(tiny_fp32):
    """Greedy, n > 1 (seeded sampling) and beam search through the whole engine: native == eager."""
    loaded, step, _ = tiny_fp32
    results = []
    try:
        for native_step in (step, None):
            loaded.model.native_step = native_step
            results.append(sampling_mix_outputs(loaded, 4))
    finally:
        loaded.model.native_step = None
    assert results[0] == results[1]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "early_exit"])
def test_speculative_decoding_through_the_native_step_keeps_the_greedy_tokens(tiny_q4, native_calls, method):
    """Verification rows are decode rows (one per drafted position, each at its own context length): the
    native step runs them, and greedy drafts verified there leave the tokens of plain decoding."""
    loaded, step, _ = tiny_q4
    spec = {"ngram": NGRAM, "early_exit": EARLY_EXIT}[method]
    prompts = [[5, 17, 300, 5, 17, 300, 5, 17], [9, 9, 40, 9, 9, 40, 9]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    try:
        loaded.model.native_step = step
        for speculative in (None, SpeculativeConfig.parse(spec)):
            engine = LLMEngine(loaded, EngineConfig(num_blocks=64, metrics_interval_s=3600.0), speculative=speculative)
            for i, ids in enumerate(prompts):
                engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
            runs.append({rid: out.outputs[0].token_ids for rid, out in run(engine).items()})
            assert_all_blocks_free(engine)
    finally:
        loaded.model.native_step = None
    assert runs[1] == runs[0]
    assert any(rows > len(prompts) for rows in native_calls)  # some step verified drafts natively


class NotOurs(Kernel):
    """A kernel the native step does not run (torch's, by name), computing what ours computes."""

    name = "int4pack/fp32"

    def __init__(self, ours: Kernel):
        self.ours = ours

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ours(x)


def test_a_row_count_whose_plan_is_not_ours_runs_the_other_path(tiny_q4):
    loaded, _, engine = tiny_q4
    layer = loaded.model.layers[0].mlp.down_proj
    plan = layer.plan
    try:
        assert product_kinds(loaded.model.layers, 3) is not None
        layer.plan = [(2, plan[0][1]), (2**62, NotOurs(plan[0][1]))]
        fresh = NativeDecodeStep(loaded.model)  # row counts are looked up once per step object
        assert fresh.kinds(2) is not None and fresh.kinds(3) is None
        works = random_decode_works(random.Random(4), 3, engine.block_manager.num_blocks, max_width=6)
        eager = _step(loaded, engine, None, works)
        torch.testing.assert_close(_step(loaded, engine, fresh, works), eager, atol=0, rtol=0)
    finally:
        layer.plan = plan


def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(tiny_q4):
    loaded, step, engine = tiny_q4
    works = random_decode_works(random.Random(5), 2, engine.block_manager.num_blocks, max_width=6)
    pools = [pool.clone() for pool in (*engine.kv_cache.k, *engine.kv_cache.v)]
    real_slot = engine.runner._slot
    engine.runner._slot = lambda table, position: 10**9
    try:
        with pytest.raises(RuntimeError, match="slot 1000000000 outside the pool"):
            _step(loaded, engine, step, works)
    finally:
        engine.runner._slot = real_slot
    assert all(torch.equal(a, b) for a, b in zip(pools, (*engine.kv_cache.k, *engine.kv_cache.v)))


def test_a_position_past_the_rotary_tables_is_refused_before_anything_is_written(tiny_q4, monkeypatch):
    """The call reads each row's rotary rows at its position in the model's whole tables: a position past
    them is an error naming it, not a read outside them."""
    loaded, step, engine = tiny_q4
    table_rows = loaded.model.rotary.cos.shape[0]
    real = torch.ops.minivllm_native.decode_layers
    monkeypatch.setattr(
        torch.ops.minivllm_native, "decode_layers", lambda x, positions, *rest: real(x, positions + table_rows, *rest)
    )
    works = random_decode_works(random.Random(8), 2, engine.block_manager.num_blocks, max_width=4)
    pools = [pool.clone() for pool in (*engine.kv_cache.k, *engine.kv_cache.v)]
    with pytest.raises(
        RuntimeError,
        match=f"position {table_rows + works[0].num_computed} outside the rotary tables' {table_rows} positions",
    ):
        _step(loaded, engine, step, works)
    assert all(torch.equal(a, b) for a, b in zip(pools, (*engine.kv_cache.k, *engine.kv_cache.v)))


def test_a_block_outside_the_pool_is_refused_before_anything_is_written(tiny_q4):
    """Block tables are checked once, before the first layer writes its K/V (not by each layer's attention)."""
    loaded, step, engine = tiny_q4
    block_size = engine.kv_cache.block_size
    works = [SeqWork([5], block_size + 3, [engine.block_manager.num_blocks + 7, 3])]  # the token's slot is in block 3
    pools = [pool.clone() for pool in (*engine.kv_cache.k, *engine.kv_cache.v)]
    with pytest.raises(RuntimeError, match=f"block id {engine.block_manager.num_blocks + 7} outside the pool"):
        _step(loaded, engine, step, works)
    assert all(torch.equal(a, b) for a, b in zip(pools, (*engine.kv_cache.k, *engine.kv_cache.v)))


def test_a_weight_of_the_wrong_size_is_named_before_anything_runs(tiny_q4):
    loaded, step, engine = tiny_q4
    bad = copy.copy(step)
    weights = list(step.weights)
    weights[WEIGHTS_PER_LAYER + 2] = weights[WEIGHTS_PER_LAYER + 1]  # layer 1's O product given its QKV weight
    bad.weights = tuple(weights)
    works = random_decode_works(random.Random(6), 2, engine.block_manager.num_blocks, max_width=4)
    pools = [pool.clone() for pool in (*engine.kv_cache.k, *engine.kv_cache.v)]
    hidden = loaded.config.hidden_size
    with pytest.raises(RuntimeError, match=f"layer 1: product weight 2 must have {hidden} output rows"):
        _step(loaded, engine, bad, works)
    assert all(torch.equal(a, b) for a, b in zip(pools, (*engine.kv_cache.k, *engine.kv_cache.v)))


@pytest.mark.slow
def test_fp32_native_logits_match_eager_within_1e_4_for_every_decode_shape(tiny_fp32, native_calls):
    loaded, step, engine = tiny_fp32
    assert step is not None and step.kinds(1) == [3] * 4 * len(loaded.model.layers)
    rng = random.Random(6)
    shapes = [1, 2, 3, 4, 2]
    for rows in shapes:
        works = random_decode_works(rng, rows, engine.block_manager.num_blocks, max_width=6)
        eager = _step(loaded, engine, None, works)
        torch.testing.assert_close(_step(loaded, engine, step, works), eager, atol=1e-4, rtol=0)
    assert native_calls == shapes


def block_scaled_int8(kernel: str, dtype: torch.dtype = torch.float16):
    """A tiny model with int8 weights as GGUF Q8_0 holds them (a scale per block of 32, each its own, in `dtype`)
    on our `kernel`, its native step, and an engine."""
    loaded = load_model("random:tiny", quantization=QuantConfig("int8", kernel=kernel), max_model_len=256)
    generator = torch.Generator().manual_seed(7)
    for layer in loaded.model.modules():
        if isinstance(layer, QuantLinear) and "layers." in layer.name:
            blocks = layer.in_features // 32
            row = layer.candidates[0].scale.view(-1, 1)
            scales = (row * (0.5 + torch.rand(row.shape[0], blocks, generator=generator))).to(dtype).contiguous()
            for candidate in layer.candidates:
                candidate.scale = scales
    engine = make_engine(loaded, max_num_seqs=4, block_size=16, num_blocks=96)
    return loaded, NativeDecodeStep.for_model(loaded.model), engine


@pytest.fixture(scope="module", params=[("int8x2", torch.float16), ("fp32", torch.float16), ("int8x2", torch.float32)])
def tiny_int8(request):
    return request.param[0], *block_scaled_int8(*request.param)


@pytest.mark.slow
def test_int8_weights_run_natively_with_their_block_scales(tiny_int8, native_calls):
    """Q8_0 files' layers: the int8 codes go in as the weight, the scales among the pieces; every decode shape
    against the eager layers (fp32 activations within 1e-4: the same products' bits)."""
    kernel, loaded, step, engine = tiny_int8
    kind = {"int8": 7, "int8x2": 8, "fp32": 9}[kernel]
    assert step is not None and step.kinds(1) == [kind] * 4 * len(loaded.model.layers)
    rng = random.Random(9)
    shapes = [1, 3, 4]
    for rows in shapes:
        works = random_decode_works(rng, rows, engine.block_manager.num_blocks, max_width=6)
        eager = _step(loaded, engine, None, works)
        native_logits = _step(loaded, engine, step, works)
        if kernel == "fp32":
            torch.testing.assert_close(native_logits, eager, atol=1e-4, rtol=0)
        else:
            _assert_near(native_logits, eager)
    assert native_calls == shapes


def test_an_int8_weights_scales_are_checked_before_anything_is_written(tiny_q4):
    loaded, step, engine = block_scaled_int8("int8x2")
    works = random_decode_works(random.Random(10), 2, engine.block_manager.num_blocks, max_width=4)
    pools = [pool.clone() for pool in (*engine.kv_cache.k, *engine.kv_cache.v)]
    per_layer = len(PIECES)
    for index, replacement, message in [
        (per_layer + SCALES + 2, ABSENT, "layer 1: product 2's int8 weight needs its scales"),
        (SCALES + 1, step.pieces[SCALES + 1][:1], "one per output row \\(fp32\\) or one per block of 32"),
    ]:
        bad = copy.copy(step)
        bad.pieces = tuple(replacement if i == index else t for i, t in enumerate(step.pieces))
        with pytest.raises(RuntimeError, match=message):
            _step(loaded, engine, bad, works)
    assert all(torch.equal(a, b) for a, b in zip(pools, (*engine.kv_cache.k, *engine.kv_cache.v)))


@pytest.mark.slow
def test_mkl_products_and_enforce_eager_have_no_native_step(tiny_model):
    """The session's tiny fp32 model as loaded: MKL serves it or ours does (a timing); MKL has no native step."""
    mkl = any(isinstance(m, PackedLinear) and not m.native for m in tiny_model.model.modules())
    assert (NativeDecodeStep.for_model(tiny_model.model) is None) == mkl
    assert create_engine("random:tiny", enforce_eager=True).loaded.model.native_step is None


@pytest.mark.slow
def test_the_default_engine_runs_it_and_says_so(monkeypatch, capfd):
    monkeypatch.setenv("MINIVLLM_ENFORCE_EAGER", "0")  # the test session's default is eager (conftest)
    engine = create_engine(
        "random:tiny", EngineConfig(max_num_seqs=2), quantization=QuantConfig("int4", kernel="int8x2")
    )
    info = engine.info().compilation
    # every decode step up to max_num_seqs runs natively: no compiled step is built
    assert info == NativeDecodeStep.DESCRIPTION and engine.loaded.model.compiled is None, info
    err = capfd.readouterr().err
    assert info in err and "compiling decode step" not in err


def test_the_default_engine_imports_no_compiler(embedded_model):
    """The embedded model at its defaults in a fresh process (the session's loads have filled the
    cache): the native step runs every decode step, so torch's compiler is never imported, and neither
    are transformers' config classes (the cached config is ours); either costs ~50-70 MiB of RSS."""
    script = (
        "import sys; from minivllm import LLM, SamplingParams; llm = LLM(); "
        "out = llm.generate(['Hi'], SamplingParams(max_tokens=4)); "
        "print(llm.engine.info().compilation); "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy', "
        "'transformers.core_model_loading') if m in sys.modules))"
    )
    env = {**os.environ, "MINIVLLM_ENFORCE_EAGER": "0"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compilation, imported = done.stdout.strip().splitlines()[-2:]
    assert compilation == NativeDecodeStep.DESCRIPTION
    assert imported == "[]"


QUESTIONS = ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")


def _eager_and_native(loaded, step, params: SamplingParams) -> tuple[dict, dict]:
    """The questions' final outputs eagerly, then through the native step (one request at a time)."""
    runs = []
    try:
        for native_step in (None, step):
            loaded.model.native_step = native_step
            engine = make_engine(loaded, max_num_seqs=1, num_blocks=32)
            for i, question in enumerate(QUESTIONS):
                engine.add_request(f"r{i}", prompt_token_ids=chat_ids(loaded.tokenizer, question), params=params)
            runs.append(run(engine))
    finally:
        loaded.model.native_step = None
    return runs[0], runs[1]


def test_embedded_model_greedy_parts_from_eager_only_at_near_ties(embedded_model_q4):
    """The default precision: the int8x2 activation rounding can turn a last-bit difference of the norm
    into a flipped near-tie, as for the compiled step (engine_utils.first_part_at_a_near_tie)."""
    step = NativeDecodeStep.for_model(embedded_model_q4.model)
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5, ignore_eos=True)
    eager, native_run = _eager_and_native(embedded_model_q4, step, params)
    for rid in eager:
        first_part_at_a_near_tie(eager[rid].outputs[0], native_run[rid].outputs[0])


def test_embedded_model_in_fp32_decodes_the_eager_greedy_tokens(embedded_model):
    linears = [m for m in embedded_model.model.modules() if isinstance(m, PackedLinear)]
    chosen = [m.native for m in linears]
    try:
        for m in linears:  # our fp32 kernel, whichever won at load on this machine
            m.native = True
        step = NativeDecodeStep.for_model(embedded_model.model)
        eager, native_run = _eager_and_native(embedded_model, step, SamplingParams(temperature=0, max_tokens=32))
    finally:
        for m, native_chosen in zip(linears, chosen):
            m.native = native_chosen
    assert {r: o.outputs[0].token_ids for r, o in native_run.items()} == {
        r: o.outputs[0].token_ids for r, o in eager.items()
    }
