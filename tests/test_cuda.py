"""The CUDA path: parity with transformers in fp32 on the GPU, and decode steps replayed from CUDA
graphs (model/cuda_graphs.py; of eager kernels, and of the layers compiled by inductor + Triton)
against the same engine's eager steps; decode attention is the Triton kernel in both (and against the
portable gather + SDPA once). These need a CUDA device (run
them there with scripts/gpu_check.sh); on a CPU-only machine tests/test_decode_graphs.py covers the
graphs' bucketing, padding and static buffers through the same code without the capture."""

from __future__ import annotations

import random

import pytest
import torch
from test_model_parity import ATOL, TINY_VARIANTS, hf_forward, max_diffs, our_forward, report

from engine_utils import assert_all_blocks_free, make_engine, random_decode_works, run
from minivllm.core.step_work import SeqWork
from minivllm.loader import load_model
from minivllm.model import attention
from minivllm.model.compiled import graph_count, use_compilation
from minivllm.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: tests/test_decode_graphs.py covers the graphs on the CPU",
)

MAX_SEQS, MAX_LEN, BLOCK_SIZE = 8, 256, 16


def _tiny(directory, name: str = "gqa-untied", **extra):
    from tiny_models import make_tiny_llama

    hf = make_tiny_llama(directory, seed=len(name), vocab=512, layers=3, **{**TINY_VARIANTS[name], **extra})
    return hf, load_model(str(directory), dtype="float32", device="cuda", max_model_len=MAX_LEN)


@pytest.mark.parametrize("name", list(TINY_VARIANTS))
def test_fp32_hidden_states_and_logits_match_transformers_on_the_gpu(name, tmp_path, capsys):
    hf, loaded = _tiny(tmp_path, name)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (200, 77)]
    worst = 0.0
    for ids, (states, logits) in zip(sequences, our_forward(loaded, sequences)):
        mine = ([s.cpu() for s in states], logits.cpu())
        layer_diffs, logit_diff = max_diffs(mine, hf_forward(hf, ids))
        worst = max(worst, logit_diff, *layer_diffs)
        assert max(layer_diffs) <= ATOL and logit_diff <= ATOL, (name, layer_diffs, logit_diff)
    report(capsys, f"cuda tiny {name}: max abs diff {worst:.2e} (atol {ATOL})")


@pytest.fixture(scope="module", params=["eager kernels", "compiled layers"])
def graphed(request, tmp_path_factory):
    """A tiny fp32 model on the GPU with peaky logits (few near-ties) and an engine whose warm-up
    captured its decode graphs: of eager kernels (the default), or of the layers compiled first
    (MINIVLLM_CUDA_COMPILE=1)."""
    hf, loaded = _tiny(tmp_path_factory.mktemp("graphs"), init_std=0.2)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MINIVLLM_CUDA_COMPILE", "1" if request.param == "compiled layers" else "0")
        use_compilation(loaded.model, "cuda", enforce_eager=False)
    engine = make_engine(loaded, max_num_seqs=MAX_SEQS, block_size=BLOCK_SIZE, num_blocks=96, max_model_len=MAX_LEN)
    assert engine.runner.graphs is not None, loaded.model.compilation()
    engine.holds = request.param
    return hf, loaded, engine


class Eagerly:
    """The engine with neither graphs nor compiled layers, inside the block."""

    def __init__(self, engine):
        self.runner, self.model = engine.runner, engine.loaded.model

    def __enter__(self):
        self.kept = self.runner.graphs, self.model.compiled
        self.runner.graphs = self.model.compiled = None

    def __exit__(self, *exc):
        self.runner.graphs, self.model.compiled = self.kept


def _execute(engine, works, graphs: bool) -> torch.Tensor:
    if graphs:
        return engine.runner.execute(works, [])
    with Eagerly(engine):
        return engine.runner.execute(works, [])


def test_a_graph_per_bucket_is_captured_at_start_up(graphed):
    _, loaded, engine = graphed
    graphs = engine.runner.graphs
    assert sorted(graphs.graphs) == [(r, w) for r in (1, 2, 4, 8) for w in (2, 4, 8, 16)]
    if engine.holds == "compiled layers":
        assert loaded.model.compiled is not None and loaded.model.compiled.active, loaded.model.compilation()
    else:
        assert loaded.model.compiled is None
    assert loaded.model.compilation().startswith(f"CUDA graphs of {engine.holds}")
    assert engine.info().compilation == loaded.model.compilation()


def test_replayed_logits_match_eager_for_every_bucket(graphed):
    """Eager's logits within 1e-4 (fp32), padded to every bucket."""
    _, _, engine = graphed
    rng = random.Random(0)
    graphs = engine.runner.graphs
    before = graphs.replays
    steps = [(rows, width) for rows in range(1, MAX_SEQS + 1) for width in (1, 2, 5, 16)]
    for rows, width in steps:
        works = random_decode_works(rng, rows, 96, BLOCK_SIZE, max_width=width, vocab=512)
        eager, replayed = _execute(engine, works, False), _execute(engine, works, True)
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0, msg=lambda m: f"{rows} rows x {width}: {m}")
    assert graphs.replays - before == len(steps)


def test_200_steps_of_varying_size_replay_without_a_new_capture(graphed):
    _, _, engine = graphed
    graphs = engine.runner.graphs
    captured, before, compiled = dict(graphs.graphs), graphs.replays, graph_count()
    rng = random.Random(1)
    for _ in range(200):
        _execute(
            engine,
            random_decode_works(rng, rng.randint(1, MAX_SEQS), 96, BLOCK_SIZE, max_width=rng.randint(1, 16), vocab=512),
            True,
        )
    assert graphs.replays - before == 200 and graphs.graphs == captured and graph_count() == compiled


def test_a_mixed_step_replays_its_decode_rows(graphed):
    _, _, engine = graphed
    rng = random.Random(2)
    single = random_decode_works(rng, 3, 96, BLOCK_SIZE, vocab=512)
    chunk = SeqWork([rng.randrange(512) for _ in range(5)], 16, [40, 41], num_logits=5)
    before = engine.runner.graphs.replays
    mixed = engine.runner.execute(single, [chunk])
    assert engine.runner.graphs.replays == before + 1
    torch.testing.assert_close(mixed[:3], _execute(engine, single, True), atol=0, rtol=0)


def test_the_triton_kernel_reads_the_pool_and_matches_the_gathered_path(graphed):
    """With triton (bundled with CUDA torch) decode attention is the Triton kernel, with no decode mask
    built: graphed steps of every row count match eager steps through the portable gather + SDPA."""
    _, _, engine = graphed
    assert attention.reads_pool_with_triton(engine.runner.kv_cache.k[0]), attention._triton_missing
    rng = random.Random(4)
    for rows in (1, 3, 8):
        works = random_decode_works(rng, rows, 96, BLOCK_SIZE, max_width=16, vocab=512)
        assert engine.runner._metadata(works, [], [0] * rows).decode_mask is None
        with pytest.MonkeyPatch.context() as switch:
            switch.setattr(attention, "USE_TRITON_DECODE", False)
            portable = _execute(engine, works, False)
        torch.testing.assert_close(_execute(engine, works, True), portable, atol=1e-4, rtol=0)


def _generate(engine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    done = run(engine)
    assert_all_blocks_free(engine)
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_greedy_tokens_equal_eager_and_are_transformers_argmax(graphed):
    """Five prompts of different lengths (batches of 1-5 rows as they finish at different lengths):
    graphs and eager give the same tokens, and each token is HF's argmax on the same prefix (or within
    1e-4 of it: a tie)."""
    hf, _, engine = graphed
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 40, 9, 70)]
    graphs = engine.runner.graphs
    before = graphs.replays
    with_graphs = _generate(engine, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert graphs.replays - before >= 31
    with Eagerly(engine):
        eager = _generate(engine, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert with_graphs == eager
    for prompt, tokens in zip(prompts, with_graphs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (logits.max(1).values - chosen).max() <= 1e-4


def test_sampling_beams_and_n_through_graphs_equal_eager(graphed):
    """Seeded sampling with n > 1 and beam search through the engine: the same tokens either way."""
    _, _, engine = graphed
    mix = [
        SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=12, ignore_eos=True),
    ]

    def outputs():
        for i, params in enumerate(mix):
            engine.add_request(f"m{i}", prompt_token_ids=[5 + i, 17, 300, 400, 9], params=params)
        done = run(engine)
        assert_all_blocks_free(engine)
        return {rid: [o.token_ids for o in out.outputs] for rid, out in done.items()}

    with_graphs = outputs()
    with Eagerly(engine):
        assert outputs() == with_graphs
