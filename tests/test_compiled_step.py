"""The compiled decode step (torch.compile, inductor): same logits as eager, no recompiles in
steady state, a clear fallback when compiling fails, and the switch (--enforce-eager) plumbed."""

from __future__ import annotations

import random

import pytest
import torch

from engine_utils import chat_ids, first_part_at_a_near_tie, make_engine, random_decode_works, run, sampling_mix_outputs
from minivllm.core.step_work import SeqWork
from minivllm.engine.config import EngineConfig
from minivllm.engine.factory import create_engine
from minivllm.loader import load_model
from minivllm.model import attention
from minivllm.model.compiled import CompiledLayers, decode_row_counts, graph_count, layers_per_graph
from minivllm.quant.policy import QuantConfig
from minivllm.sampling.params import SamplingParams

MAX_ROWS = 4  # row counts 1-4: one row, padded to a bucket, exactly a bucket (one dynamic graph from 2)


@pytest.fixture(scope="module")
def tiny():
    """A tiny fp32 model (MKL-packed linears) and a compiled engine around it, warmed up."""
    loaded = load_model("random:tiny", quantization="none", max_model_len=256)
    loaded.model.compiled = CompiledLayers(layers_per_graph(len(loaded.model.layers)))
    before = graph_count()
    engine = make_engine(loaded, max_num_seqs=MAX_ROWS, block_size=16, num_blocks=96)
    assert loaded.model.compiled.active, loaded.model.compiled.error
    engine.warm_up_graphs = graph_count() - before
    return loaded, engine


@pytest.mark.slow
def test_one_graph_serves_every_row_count_and_width(tiny):
    """Row count and width are dynamic from the first trace, a row count of 1 included: the warm-up
    (1, 2 and 4 rows at three widths) compiles one graph, and a start-up traces it once."""
    _, engine = tiny
    assert engine.warm_up_graphs == 1


def _logits(loaded, engine, single, chunks, compiled: bool) -> torch.Tensor:
    keep = loaded.model.compiled
    loaded.model.compiled = keep if compiled else None
    try:
        return engine.runner.execute(single, chunks)
    finally:
        loaded.model.compiled = keep


def test_compiled_logits_match_eager_for_every_decode_shape(tiny):
    """After warm-up the graphs run with only their differentiating guards (the row count): that mode
    must pick the right graph for every shape."""
    loaded, engine = tiny
    assert loaded.model.compiled.steady
    rng = random.Random(0)
    for rows in [1, 2, 3, 4, 1, 3]:
        works = random_decode_works(rng, rows, engine.block_manager.num_blocks)
        eager = _logits(loaded, engine, works, [], compiled=False)
        compiled = _logits(loaded, engine, works, [], compiled=True)
        assert compiled.shape == (rows, loaded.config.vocab_size)
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=0)


def test_a_step_with_chunks_runs_them_eagerly_and_its_single_rows_compiled(tiny):
    """A mixed step: the chunk's rows are exactly the eager ones (chunks never reach the compiler);
    the single-token rows are exactly what the compiled step gives them alone, and eager's within 1e-4."""
    loaded, engine = tiny
    rng = random.Random(1)
    single = random_decode_works(rng, 2, engine.block_manager.num_blocks)
    chunk = SeqWork([rng.randrange(49152) for _ in range(5)], 16, [40, 41], num_logits=5)
    before = graph_count()
    eager = _logits(loaded, engine, single, [chunk], compiled=False)
    mixed = _logits(loaded, engine, single, [chunk], compiled=True)
    assert graph_count() == before
    torch.testing.assert_close(mixed[2:], eager[2:], atol=0, rtol=0)
    torch.testing.assert_close(mixed[:2], _logits(loaded, engine, single, [], compiled=True), atol=0, rtol=0)
    torch.testing.assert_close(mixed[:2], eager[:2], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_no_recompiles_in_steady_state(tiny):
    """After warm-up, 200 decode steps over every row count and many block-table widths add no graph,
    with every guard evaluated: what makes skipping the non-differentiating ones after warm-up safe."""
    loaded, engine = tiny
    assert decode_row_counts(loaded.model, MAX_ROWS) == [1, 2, 4]  # MKL buckets are picked inside an op
    rng = random.Random(2)
    before = graph_count()
    loaded.model.compiled.steady = False
    try:
        for _ in range(200):
            rows = rng.randint(1, MAX_ROWS)
            engine.runner.execute(random_decode_works(rng, rows, engine.block_manager.num_blocks), [])
    finally:
        loaded.model.compiled.steady = True
    assert graph_count() == before


def test_a_rebuilt_pool_compiles_nothing_new(tiny):
    """The dashboard's engine settings rebuild the KV pool (another block count or block size): the
    pool's sizes are dynamic in the graphs, so the re-run warm-up finds every graph compiled."""
    loaded, engine = tiny
    before = graph_count()
    try:
        engine.reconfigure(num_blocks=80, block_size=8)
        works = random_decode_works(random.Random(4), 3, 80, block_size=8)
        compiled = _logits(loaded, engine, works, [], compiled=True)
        torch.testing.assert_close(compiled, _logits(loaded, engine, works, [], compiled=False), atol=1e-4, rtol=0)
        assert graph_count() == before
    finally:
        engine.reconfigure(num_blocks=96, block_size=16)


@pytest.mark.slow
def test_engine_outputs_equal_eager_with_beams_and_n(tiny):
    """Greedy, n > 1 (seeded sampling) and beam search through the whole engine: compiled == eager."""
    loaded, _ = tiny
    eager_loaded = load_model("random:tiny", quantization="none", max_model_len=256)
    results = [sampling_mix_outputs(model, MAX_ROWS) for model in (loaded, eager_loaded)]
    assert results[0] == results[1]


def test_layers_run_in_equal_groups_and_an_early_exit_remainder_runs_eagerly(tiny):
    """Groups share one graph; an early exit that ends inside a group (the speculative self-draft)
    runs the whole groups compiled and the rest eagerly, with eager's logits and no new graph."""
    assert [layers_per_graph(n) for n in (30, 22, 32, 7, 2)] == [6, 2, 4, 1, 2]
    loaded, engine = tiny
    group = loaded.model.compiled.group
    assert group == layers_per_graph(len(loaded.model.layers)) and group > 1
    works = random_decode_works(random.Random(5), 2, engine.block_manager.num_blocks)
    before = graph_count()
    partial = group + 1 if group + 1 < len(loaded.model.layers) else group - 1
    for num_layers in (partial, len(loaded.model.layers)):
        eager = loaded.model.compiled
        loaded.model.compiled = None
        try:
            expected = engine.runner.execute(works, [], num_layers=num_layers)
        finally:
            loaded.model.compiled = eager
        torch.testing.assert_close(engine.runner.execute(works, [], num_layers=num_layers), expected, atol=1e-4, rtol=0)
    assert graph_count() == before


@pytest.mark.slow
def test_compile_failure_falls_back_to_eager_with_one_warning(tiny, capfd):
    loaded, engine = tiny

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler here")

    keep = loaded.model.compiled
    loaded.model.compiled = CompiledLayers(keep.group, backend=broken_backend)
    try:
        works = random_decode_works(random.Random(3), 3, engine.block_manager.num_blocks)
        out = engine.runner.execute(works, [])
        again = engine.runner.execute(works, [])
        assert not loaded.model.compiled.active
        assert "no C++ compiler here" in loaded.model.compilation()
        assert loaded.model.compilation().startswith("eager (compiling failed")
    finally:
        loaded.model.compiled = keep
    warnings = [line for line in capfd.readouterr().err.splitlines() if "torch.compile failed" in line]
    assert len(warnings) == 1 and "no C++ compiler here" in warnings[0]
    torch.testing.assert_close(out, _logits(loaded, engine, works, [], compiled=False), atol=0, rtol=0)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


@pytest.mark.slow
def test_enforce_eager_and_the_default(monkeypatch, capfd):
    monkeypatch.delenv("MINIVLLM_ENFORCE_EAGER", raising=False)
    eager = create_engine("random:tiny", enforce_eager=True)
    assert eager.loaded.model.compiled is None
    assert eager.info().compilation == "eager (--enforce-eager)"
    monkeypatch.setenv("MINIVLLM_ENFORCE_EAGER", "1")
    assert create_engine("random:tiny").info().compilation == "eager (--enforce-eager)"
    monkeypatch.setenv("MINIVLLM_ENFORCE_EAGER", "0")
    default = create_engine("random:tiny", EngineConfig(max_num_seqs=2), quantization="none")
    model = default.loaded.model
    if model.native_step is not None:  # our fp32 kernel beat MKL for the tiny model when timed at load:
        # the native step runs every decode step, so no compiled step is built (nor torch's compiler imported)
        assert model.compiled is None and default.info().compilation == model.native_step.describe()
        assert "compiling decode step" not in capfd.readouterr().err
    else:
        assert default.info().compilation.startswith("compiled (inductor")
        assert "compiling decode step 1/" in capfd.readouterr().err


@pytest.mark.slow
def test_the_compiled_step_is_built_where_the_native_step_cannot_run_every_decode_step(monkeypatch, capfd):
    """Without the native attention (the portable path's pool), neither a native step nor a model's 4-bit
    products on our kernels can serve decode steps: the warm-up builds and compiles the compiled step."""
    monkeypatch.setenv("MINIVLLM_ENFORCE_EAGER", "0")
    monkeypatch.setattr(attention, "USE_NATIVE_DECODE", False)
    engine = create_engine(
        "random:tiny", EngineConfig(max_num_seqs=2), quantization=QuantConfig("int4", kernel="int8x2")
    )
    assert engine.loaded.model.compiled is not None and engine.loaded.model.compiled.steady
    assert "otherwise compiled (inductor" in engine.info().compilation, engine.info().compilation
    assert "compiling decode step 1/" in capfd.readouterr().err


def _eager_and_compiled(loaded, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, dict]:
    """The prompts' final outputs with the model eager, then compiled (one request at a time)."""
    runs = []
    try:
        for compiled in (None, CompiledLayers(layers_per_graph(len(loaded.model.layers)))):
            loaded.model.compiled = compiled
            engine = make_engine(loaded, max_num_seqs=1, num_blocks=32)
            for i, ids in enumerate(prompts):
                engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
            runs.append(run(engine))
    finally:
        loaded.model.compiled = None
    return runs[0], runs[1]


def test_greedy_tokens_identical_on_the_embedded_model_in_fp32(embedded_model):
    """The embedded model dequantized to fp32: compiled and eager decode the same tokens."""
    loaded = embedded_model
    prompts = [chat_ids(loaded.tokenizer, q) for q in ("What is the capital of France?", "Name three colors.")]
    eager, compiled = _eager_and_compiled(loaded, prompts, SamplingParams(temperature=0, max_tokens=32))
    assert {rid: out.outputs[0].token_ids for rid, out in compiled.items()} == {
        rid: out.outputs[0].token_ids for rid, out in eager.items()
    }


def test_default_precision_parts_from_eager_only_at_near_ties(embedded_model_q4):
    """At the 4-bit default the kernels take rounded activations (int8 blocks in ours, bf16 in torch's),
    and the compiled step rounds its fused norm from a differently ordered sum: a last-bit difference
    can flip a near-tie. Where the
    compiled greedy run parts from the eager one, it must take the eager run's runner-up, and the two
    must have been within engine_utils.NEAR_TIE_NATS."""
    loaded = embedded_model_q4
    questions = ("What is the capital of France?", "Name three colors.", "Write a haiku about the sea.")
    prompts = [chat_ids(loaded.tokenizer, q) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5, ignore_eos=True)  # a tie can be 3-way
    runs = _eager_and_compiled(loaded, prompts, params)
    for rid in runs[0]:
        first_part_at_a_near_tie(runs[0][rid].outputs[0], runs[1][rid].outputs[0])


@pytest.mark.slow
@pytest.mark.parametrize("user_choice", [False, True])
def test_compiled_kernels_persist_in_our_cache_folder(tmp_path, user_choice):
    """Inductor's kernels go to $MINIVLLM_CACHE_DIR/inductor (a second start is then fast, and a
    container keeps them on its volume), even though importing the engine asks torch for its cache
    folder, which writes torch's /tmp default for the process; a folder the user set wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["MINIVLLM_CACHE_DIR"] = str(tmp_path / "ours")
    if user_choice:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "theirs")
    script = (
        "import minivllm.kernels.cpu.native, minivllm.engine.factory\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "print(cache_dir())"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    expected = tmp_path / ("theirs" if user_choice else "ours/inductor")
    assert out.stdout.strip() == str(expected)


def test_a_packed_linear_equals_the_plain_product_at_every_row_count():
    """The bucket is picked inside one opaque operator: a batch padded up to a bucket, exactly a bucket,
    beyond the largest and below the smallest all give F.linear's product."""
    from minivllm.model.packed_linear import PackedLinear, packing_supported

    torch.manual_seed(0)
    layer = PackedLinear(64, 96, bias=False)
    if not packing_supported(layer.weight):
        pytest.skip("torch was built without MKL here: nothing is packed")
    layer.pack((4, 8))
    for rows in range(1, 12):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_a_decode_row_keeps_its_bits_when_a_prompt_shares_its_step(tiny):
    """Single-token rows run through the compiled step even beside a prefill chunk (a pass of their
    own): their logits are bit-identical with and without the chunk, so a token (and a seeded sample)
    cannot depend on whether another request's prompt shared its step."""
    _, engine = tiny
    decode = SeqWork([5], 20, [20, 21])
    alone = engine.runner.execute([decode], [])
    mixed = engine.runner.execute([decode], [SeqWork(list(range(3, 40)), 0, [10, 11, 12])])
    assert mixed.shape[0] == 2 and torch.equal(mixed[:1], alone)
