"""Decode graphs (model/cuda_graphs.py) on any machine: the bucketing, the padding into the scratch
block and the static input buffers, run through `no_capture` (the same path, each replay computed
eagerly). The capture itself needs CUDA: tests/test_cuda.py."""

from __future__ import annotations

import random

import pytest
import torch

from engine_utils import random_decode_works
from minivllm.core.step_work import SeqWork
from minivllm.engine.model_runner import ModelRunner
from minivllm.loader import load_model
from minivllm.model import cuda_graphs
from minivllm.model.attention import KVCache
from minivllm.model.compiled import use_compilation
from minivllm.model.cuda_graphs import DecodeGraphs, bucket_for, buckets, no_capture

BLOCKS, BLOCK_SIZE, MAX_ROWS, MAX_WIDTH = 48, 16, 8, 8


def test_buckets_are_powers_of_two_then_the_limit():
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(1) == [1]
    assert buckets(10, first=2) == [2, 4, 8, 10]
    assert buckets(1, first=2) == [2]
    assert bucket_for([1, 2, 4, 6], 3) == 4 and bucket_for([1, 2, 4, 6], 6) == 6
    assert bucket_for([1, 2, 4, 6], 7) is None


class Counting:
    """`no_capture`, counting the steps each bucket replays."""

    def __init__(self):
        self.replays: dict[int, int] = {}

    def __call__(self, step):
        key = len(self.replays)
        self.replays[key] = -1  # the capture's own run is not a replay

        def replay():
            self.replays[key] += 1
            return step()

        replay()
        return replay

    @property
    def total(self) -> int:
        return sum(self.replays.values())


@pytest.fixture(scope="module")
def tiny():
    """A tiny fp32 model run eagerly, a pool of random K/V (plus the scratch block), and its graphs."""
    loaded = load_model("random:tiny", device="cpu", quantization="none", max_model_len=2 * MAX_WIDTH * BLOCK_SIZE)
    use_compilation(loaded.model, "cpu", enforce_eager=True)
    cfg = loaded.config
    kv = KVCache(
        cfg.num_hidden_layers,
        BLOCKS,
        BLOCK_SIZE,
        cfg.num_key_value_heads,
        cfg.head_dim,
        torch.float32,
        scratch_block=True,
    )
    gen = torch.Generator().manual_seed(0)
    for pool in (*kv.k, *kv.v):
        pool[:BLOCKS].copy_(torch.randn(pool[:BLOCKS].shape, generator=gen))
    runner = ModelRunner(loaded.model, kv)
    counting = Counting()
    graphs = DecodeGraphs(loaded.model, kv, MAX_ROWS, MAX_WIDTH, capture=counting)
    return loaded, runner, graphs, counting


def _logits(runner, graphs, single, chunks=(), **kwargs):
    runner.graphs = graphs
    try:
        return runner.execute(single, list(chunks), **kwargs)
    finally:
        runner.graphs = None


@pytest.mark.slow
def test_one_graph_per_row_and_width_bucket(tiny):
    _, _, graphs, counting = tiny
    assert sorted(graphs.graphs) == [(r, w) for r in (1, 2, 4, 8) for w in (2, 4, 8)]
    assert len(counting.replays) == 12
    assert "12 graphs" in graphs.describe()


@pytest.mark.slow
def test_every_row_count_and_width_matches_eager(tiny):
    """Padded rows and columns change nothing in the real rows: each step's logits are eager's."""
    _, runner, graphs, counting = tiny
    rng = random.Random(0)
    before = counting.total
    steps = [(rows, width) for rows in range(1, MAX_ROWS + 1) for width in (1, 3, MAX_WIDTH)]
    for rows, width in steps:
        works = random_decode_works(rng, rows, BLOCKS, BLOCK_SIZE, max_width=width)
        eager = runner.execute(works, [])
        replayed = _logits(runner, graphs, works)
        assert replayed.shape == eager.shape
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=0)
    assert counting.total - before == len(steps)


def test_padding_writes_only_the_scratch_block(tiny):
    """A 3-row step padded to 4: the rows' own slots change, every other block of the pool keeps its
    bytes, and the padding row's K/V lands in the scratch block."""
    _, runner, graphs, _ = tiny
    works = [SeqWork([7 + i], 20 + i, [10 + 2 * i, 11 + 2 * i]) for i in range(3)]
    kv = runner.kv_cache
    for pool in kv.k:
        pool[kv.scratch_block].zero_()
    before = [pool.clone() for pool in kv.k]
    _logits(runner, graphs, works)
    written = {(w.block_table[1], (20 + i) % BLOCK_SIZE) for i, w in enumerate(works)}
    for layer, pool in enumerate(kv.k):
        for block in range(BLOCKS):
            for offset in range(BLOCK_SIZE):
                same = torch.equal(pool[block, offset], before[layer][block, offset])
                assert same != ((block, offset) in written), (layer, block, offset)
    assert all(pool[kv.scratch_block, 0].abs().sum() > 0 for pool in kv.k)  # the padding row: position 0


def test_a_mixed_step_replays_its_single_rows_and_runs_chunks_eagerly(tiny):
    """The chunk's rows are eager's bit for bit; the single rows are what they get alone."""
    _, runner, graphs, counting = tiny
    rng = random.Random(1)
    single = random_decode_works(rng, 3, BLOCKS, BLOCK_SIZE)
    chunk = SeqWork([rng.randrange(49152) for _ in range(5)], 16, [40, 41], num_logits=5)
    eager = runner.execute(single, [chunk])
    before = counting.total
    mixed = _logits(runner, graphs, single, [chunk])
    assert counting.total == before + 1
    torch.testing.assert_close(mixed[3:], eager[3:], atol=0, rtol=0)
    torch.testing.assert_close(mixed[:3], _logits(runner, graphs, single), atol=0, rtol=0)


def test_steps_no_graph_holds_run_eagerly(tiny):
    """More rows or blocks than the largest bucket, hidden-state capture and an early exit: eager."""
    loaded, runner, graphs, counting = tiny
    rng = random.Random(2)
    before = counting.total
    too_many = random_decode_works(rng, MAX_ROWS + 1, BLOCKS, BLOCK_SIZE)
    torch.testing.assert_close(_logits(runner, graphs, too_many), runner.execute(too_many, []), atol=0, rtol=0)
    too_wide = [SeqWork([5], MAX_WIDTH * BLOCK_SIZE, list(range(1, MAX_WIDTH + 2)))]
    torch.testing.assert_close(_logits(runner, graphs, too_wide), runner.execute(too_wide, []), atol=0, rtol=0)
    works = random_decode_works(rng, 2, BLOCKS, BLOCK_SIZE)
    hidden: list[torch.Tensor] = []
    _logits(runner, graphs, works, hidden_states_out=hidden)
    assert len(hidden) == loaded.config.num_hidden_layers + 1
    _logits(runner, graphs, works, num_layers=1)
    assert counting.total == before


def test_prompt_logprob_rows_of_a_one_token_chunk_come_from_the_replayed_step(tiny):
    """A one-token prefill chunk is a single row: its prompt log-prob reaches its sink from the graph."""
    from minivllm.core.step_work import PromptLogprobsRows

    _, runner, graphs, _ = tiny
    got = {}

    def sink(which):
        return lambda entries, ranks: got.setdefault(which, (entries, ranks))

    for which, use in (("eager", None), ("graph", graphs)):
        work = SeqWork([11], 30, [3, 4], num_logits=0, prompt_logprobs=PromptLogprobsRows(0, [42], 2, sink(which)))
        runner.graphs = use
        try:
            assert runner.execute([work], []).shape[0] == 0
        finally:
            runner.graphs = None
    assert set(got) == {"eager", "graph"}
    torch.testing.assert_close(torch.as_tensor(got["graph"][1]), torch.as_tensor(got["eager"][1]))


def test_a_failed_capture_leaves_decode_eager_with_one_warning(tiny, monkeypatch, capsys):
    loaded, _, _, _ = tiny
    cfg = loaded.config

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("minivllm.engine.model_runner.DecodeGraphs", broken)
    monkeypatch.setattr(loaded.model, "may_capture", True)
    kv = KVCache(
        cfg.num_hidden_layers, 8, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim, torch.float32, scratch_block=True
    )
    runner = ModelRunner(loaded.model, kv).warmed_up(4, 64)
    assert runner.graphs is None and not loaded.model.may_capture
    assert "CUDA graph capture failed: RuntimeError: operation not permitted" in loaded.model.compilation()
    assert capsys.readouterr().err.count("WARNING") == 1
    assert runner.execute([SeqWork([3], 5, [1])], []).shape == (1, cfg.vocab_size)
    loaded.model.eager_reason = "--enforce-eager"


def test_graphs_need_a_scratch_block(tiny):
    loaded, _, _, _ = tiny
    cfg = loaded.config
    kv = KVCache(cfg.num_hidden_layers, 8, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    assert kv.scratch_block is None and kv.k[0].shape[0] == 8
    with pytest.raises(ValueError, match="scratch block"):
        DecodeGraphs(loaded.model, kv, 2, 2, capture=no_capture)


def test_cuda_turns_capture_on_unless_eager_and_compiling_on_request(monkeypatch):
    class Model(torch.nn.Module):
        may_capture = may_compile = False
        native_step = None
        config = type("Config", (), {"attention_window": None})()

    model = Model()
    monkeypatch.delenv("MINIVLLM_CUDA_COMPILE", raising=False)
    use_compilation(model, "cuda", enforce_eager=False)
    assert model.may_capture and not model.may_compile and model.native_step is None
    monkeypatch.setenv("MINIVLLM_CUDA_COMPILE", "1")
    use_compilation(model, "cuda", enforce_eager=False)
    assert model.may_capture and model.may_compile
    use_compilation(model, "cuda", enforce_eager=True)
    assert not model.may_capture and model.eager_reason == "--enforce-eager"


@pytest.mark.slow
def test_the_cuda_warm_up_compiles_then_captures_the_compiled_layers(monkeypatch):
    """The CUDA start-up with MINIVLLM_CUDA_COMPILE=1, here with `no_capture` for the capture: the
    runner compiles the decode layers, then captures graphs that run them; replayed logits are
    eager's within 1e-4."""
    loaded = load_model("random:tiny", device="cpu", quantization="none", max_model_len=64, seed=3)
    model, cfg = loaded.model, loaded.config
    monkeypatch.setenv("MINIVLLM_CUDA_COMPILE", "1")
    use_compilation(model, "cuda", enforce_eager=False)
    monkeypatch.setattr(cuda_graphs, "CudaGraphCapture", lambda: no_capture)
    kv = KVCache(
        cfg.num_hidden_layers, 16, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim, torch.float32, scratch_block=True
    )
    runner = ModelRunner(model, kv).warmed_up(4, 64)
    assert model.compiled is not None and model.compiled.active, model.compilation()
    assert model.compilation().startswith("CUDA graphs of compiled layers (inductor")
    rng = random.Random(4)
    for rows in (1, 3, 4):
        works = random_decode_works(rng, rows, 16, BLOCK_SIZE, max_width=4)
        replayed = runner.execute(works, [])
        graphs, compiled = runner.graphs, model.compiled
        runner.graphs = model.compiled = None
        try:
            eager = runner.execute(works, [])
        finally:
            runner.graphs, model.compiled = graphs, compiled
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)
    assert runner.graphs.replays == 3


@pytest.mark.slow
def test_verify_steps_of_speculation_replay_graphs_sized_for_their_drafts(monkeypatch):
    """With n-gram speculation a verify step holds each sequence's last token and its drafts: the
    graphs are captured up to that many rows, verify steps replay them, and the greedy tokens are
    the eager engine's."""
    from test_speculative import repetitive_prompts

    from engine_utils import NGRAM, run
    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling.params import SamplingParams
    from minivllm.spec_decode.config import SpeculativeConfig

    monkeypatch.setattr(cuda_graphs, "CudaGraphCapture", lambda: no_capture)
    monkeypatch.delenv("MINIVLLM_CUDA_COMPILE", raising=False)
    loaded = load_model("random:tiny", device="cpu", quantization="none", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = repetitive_prompts()
    outputs, widest = {}, []
    for mode in ("graphs", "eager"):
        use_compilation(loaded.model, "cuda", enforce_eager=mode == "eager")
        engine = LLMEngine(
            loaded,
            EngineConfig(max_num_seqs=4, num_blocks=64, metrics_interval_s=3600.0),
            speculative=SpeculativeConfig.parse(NGRAM),
        )
        if mode == "graphs":
            graphs = engine.runner.graphs
            assert graphs.row_sizes[-1] == 4 * (1 + NGRAM["num_speculative_tokens"])
            run_graph = graphs.run

            def replayed(ids, *rest):
                hidden = run_graph(ids, *rest)
                if hidden is not None:
                    widest.append(len(ids))
                return hidden

            monkeypatch.setattr(graphs, "run", replayed)
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
        outputs[mode] = {rid: out.outputs[0].token_ids for rid, out in run(engine).items()}
    assert max(widest) > 4  # verify steps: more rows than sequences, replayed
    assert outputs["graphs"] == outputs["eager"]
