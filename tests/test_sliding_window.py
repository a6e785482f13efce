"""Mistral's sliding-window attention, exact at any length, against transformers' `MistralForCausalLM`.

The query at position p attends to keys in (p - W, p]. A tiny random Mistral with a 16-token window (4-token
blocks in the engine) is run far past its window: fp32 logits at every position within 1e-4 of HF's (one
prefill, and chunk by chunk through the pool), 32 greedy tokens past the window equal to HF `generate`
alone, batched, preempted, with the gather path, the native and compiled steps and through a GGUF file; the native
decode kernel equal to the gathered one; and a long sequence holds at most ceil(W / block) + 1 blocks, the
others freed (and shown as such) as they leave the window.
"""

from __future__ import annotations

import pytest
import torch
from test_model_families import ATOL, assert_parity, hf_greedy, native_step_on, report
from test_model_family_mistral import make_tiny_mistral, write_llama_gguf

from engine_utils import EventLog, assert_all_blocks_free, make_engine, run
from minivllm.arith import ceil_div
from minivllm.core.block_manager import FREED, BlockManager
from minivllm.engine.scoring import forward_in_chunks
from minivllm.events import types as ev
from minivllm.loader import load_model
from minivllm.model import attention
from minivllm.sampling.params import SamplingParams

WINDOW, BLOCK = 16, 4
NEW_TOKENS = 32
BOUND = ceil_div(WINDOW, BLOCK) + 1  # the blocks a sequence's window spans at most
# a prompt within the window, one of 2.5 windows and one of 3.5 windows: all generate 32 tokens past it
PROMPTS = [
    [1, 17, 42, 99, 7],
    [1, *range(3, 42)],
    [1, 88, 12, 64, 23, 101, 45, 9, 77, 5, 6, 120, 31] * 4 + [2, 3, 4, 5],
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, embedded_tokenizer):
    directory = tmp_path_factory.mktemp("mistral-window-16")
    hf = make_tiny_mistral(directory, embedded_tokenizer, seed=16, sliding_window=WINDOW)
    return hf, load_model(str(directory), dtype="float32", device="cpu"), directory


@pytest.fixture(scope="module")
def expected(pair):
    hf, _, _ = pair
    return {f"r{i}": hf_greedy(hf, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)}


def greedy(loaded, prompts, on_step=None, **config) -> tuple[dict[str, list[int]], EventLog]:
    engine = make_engine(loaded, **({"block_size": BLOCK} | config))
    log = EventLog(engine)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
    done = run(engine, on_step=None if on_step is None else lambda _: on_step(engine))
    assert_all_blocks_free(engine)
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}, log


def test_config_keeps_the_model_context(pair):
    _, loaded, _ = pair
    cfg = loaded.config
    assert (cfg.sliding_window, cfg.attention_window, cfg.max_position_embeddings) == (WINDOW, WINDOW, 512)


def test_logits_match_hf_far_past_the_window(pair, capsys):
    """One prefill of 150 tokens (~9 windows), then the same chunk by chunk (7 tokens a step in 4-token
    blocks: each chunk reads its window's keys back from the pool, from a block boundary)."""
    hf, loaded, _ = pair
    hidden, logits = assert_parity(loaded, hf, "mistral window 16", lengths=(150, 37))
    ids = list(range(5, 155))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    chunked = forward_in_chunks(loaded, [ids], chunk=7, block_size=BLOCK)[0]
    torch.testing.assert_close(chunked, ref, atol=ATOL, rtol=0)
    worst = (chunked - ref).abs().max().item()
    report(capsys, f"mistral window {WINDOW}: hidden {hidden:.2e}, logits {logits:.2e}, chunked logits {worst:.2e}")


def test_hf_oracle_uses_its_window(pair):
    """The oracle itself: past the window HF's logits differ from full attention's (else the tests above
    would not tell a window from none)."""
    hf, _, _ = pair
    ids = torch.tensor([list(range(5, 60))])
    with torch.no_grad():
        windowed = hf(ids).logits[0, -1]
        hf.config.sliding_window = None
        try:
            full = hf(ids).logits[0, -1]
        finally:
            hf.config.sliding_window = WINDOW
    assert (windowed - full).abs().max() > 1e-3


def test_greedy_alone_batched_and_preempted(pair, expected):
    _, loaded, _ = pair
    for i, prompt in enumerate(PROMPTS):
        alone, _ = greedy(loaded, [prompt])
        assert alone["r0"] == expected[f"r{i}"], f"prompt {i} alone differs from HF"
    batched, _ = greedy(loaded, PROMPTS)
    assert batched == expected
    # each sequence holds up to 7 blocks (a window, an 8-token chunk, a partial block); 3 in 12 blocks
    # cannot all run: someone is preempted and recomputed (its prompt's freed blocks hit as cached)
    tight, log = greedy(loaded, PROMPTS, num_blocks=12, max_num_batched_tokens=8)
    assert any(e.preempted for e in log.of(ev.StepScheduled)), "the pool was never tight"
    assert tight == expected


def test_gathered_decode_path_matches(pair, expected, monkeypatch):
    """Without the native kernel decode attention gathers the tables and masks the window."""
    _, loaded, _ = pair
    monkeypatch.setattr(attention, "USE_NATIVE_DECODE", False)
    tokens, _ = greedy(loaded, PROMPTS)
    assert tokens == expected


def test_a_long_sequence_holds_a_windows_blocks(pair, expected):
    """Prefill in 8-token chunks and decode: before every step the sequence holds at most ceil(W / block)
    + 1 blocks, however long it grows; the blocks that left are freed with `dropped` events."""
    _, loaded, _ = pair
    held: list[int] = []

    def check(engine):
        bm = engine.block_manager
        for request in engine.scheduler.running:
            for seq in request.seqs:
                held.append(len(bm.held_blocks(seq.seq_id)))
                assert held[-1] <= BOUND, f"{held[-1]} blocks held, bound {BOUND}"
                assert bm.block_table(seq.seq_id)[: (seq.num_computed - WINDOW + 1) // BLOCK] == [FREED] * max(
                    0, (seq.num_computed - WINDOW + 1) // BLOCK
                )

    tokens, log = greedy(loaded, [PROMPTS[2]], on_step=check, max_num_batched_tokens=8)
    assert tokens["r0"] == expected["r2"]
    dropped = [b for e in log.of(ev.BlocksFreed) if e.dropped for b in e.block_ids]
    total = ceil_div(len(PROMPTS[2]) + NEW_TOKENS, BLOCK)
    assert len(dropped) >= total - BOUND, f"{len(dropped)} blocks left the window of {total}"
    assert max(held) == BOUND


def test_freed_blocks_stay_cached_prefix_blocks(pair, expected):
    """A block that left the window keeps its hash: the same prompt again hits the prefix cache and
    decodes the same tokens."""
    _, loaded, _ = pair
    engine = make_engine(loaded, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = []
    for rid in ("first", "again"):
        engine.add_request(rid, prompt_token_ids=PROMPTS[2], params=params)
        outputs.append(run(engine)[rid])
    assert outputs[1].metrics.num_cached_tokens > WINDOW, "the prompt's freed blocks were not hit"
    assert [o.outputs[0].token_ids for o in outputs] == [expected["r2"]] * 2
    assert_all_blocks_free(engine)


def test_block_manager_frees_whole_blocks_before_the_window():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    bm.allocate_seq(0, "r", list(range(20)))
    assert bm.ensure_capacity(0, 20)
    bm.commit_full_blocks(0, list(range(20)), 20)
    table = bm.block_table(0)
    assert bm.free_window(0, 7) == 1  # positions 0-3 left; 4-7 hold the first visible key
    assert bm.block_table(0) == [FREED, *table[1:]] and bm.held_blocks(0) == table[1:]
    assert bm.free_window(0, 7) == 0 and bm.free_window(0, 13) == 2
    assert bm.is_cached(table[0]) and bm.blocks[table[0]].ref_count == 0  # free, still a cached prefix
    bm.fork(0, 1)
    assert bm.block_table(1) == bm.block_table(0)
    bm.check_invariants()
    bm.free_seq(0)
    bm.free_seq(1)
    bm.check_invariants()
    assert bm.num_free_blocks == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_native_window_kernel_matches_the_gathered_path(dtype):
    """The native kernel's window (parts counted from the window's first block, the keys before it in
    that block masked) against gather + mask, over lengths around block and part boundaries."""
    from minivllm.kernels.cpu import native
    from minivllm.model.kv_quant import quantize

    assert native.available() is None, native.available()
    gen = torch.Generator().manual_seed(0)
    block, blocks, heads, kv_heads, dim, width = 4, 64, 4, 2, 16, 50
    rows = torch.randn(2, blocks, block, kv_heads, dim, generator=gen)
    k_pool, v_pool = (quantize(r, dtype) if dtype == torch.int8 else r.to(dtype) for r in rows)
    assert attention.reads_pool_natively(k_pool)
    lens = torch.tensor([1, 5, 16, 17, 70, 131, 200])
    for window in (1, 3, 16, 33, 500):
        tables = torch.randint(0, blocks, (len(lens), width), generator=gen)
        q = torch.randn(len(lens), heads, dim, generator=gen)
        got = attention.decode_attention(q, k_pool, v_pool, tables, lens, None, 0.25, window)
        mask = attention.decode_context_mask(lens, width * block, torch.float32, window)
        want = attention.gathered_decode_attention(q, k_pool, v_pool, tables, mask, 0.25)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0, msg=lambda m: f"window {window}: {m}")


def test_native_step_attends_within_the_window(pair, expected):
    """The C++ decode step reads each sequence's keys from its window's first block: every decode step runs
    there, 32 tokens past 3.5 windows, and the tokens are HF's."""
    _, _, directory = pair
    loaded = load_model(str(directory), dtype="float32", device="cpu")
    with native_step_on(loaded) as calls:
        tokens, _ = greedy(loaded, PROMPTS, max_num_seqs=4)
    assert len(calls) >= NEW_TOKENS - 1 and max(calls) == len(PROMPTS)
    assert tokens == expected


def test_compiled_step_serves(pair, expected):
    """The compiled step, where a product is not on our kernels: its tokens HF's."""
    from minivllm.model.compiled import CompiledLayers, graph_count, layers_per_graph

    _, _, directory = pair
    loaded = load_model(str(directory), dtype="float32", device="cpu")
    loaded.model.compiled = CompiledLayers(layers_per_graph(len(loaded.model.layers)))
    before = graph_count()
    tokens, _ = greedy(loaded, PROMPTS, max_num_seqs=4)
    assert loaded.model.compiled.active and loaded.model.compiled.steady, loaded.model.compiled.error
    assert graph_count() > before
    assert tokens == expected


def test_gguf_of_the_same_weights(pair, expected, embedded_path, tmp_path, capsys):
    """A Mistral GGUF (arch `llama`) with `llama.attention.sliding_window` is served with the same window."""
    hf, _, _ = pair
    path = tmp_path / "mistral-window.gguf"
    write_llama_gguf(hf, path, embedded_path, "Mistral-Tiny-Instruct")
    loaded = load_model(str(path), dtype="float32", device="cpu")
    cfg = loaded.config
    assert (cfg.family, cfg.attention_window, cfg.max_position_embeddings) == ("llama", WINDOW, 512)
    hidden, logits = assert_parity(loaded, hf, "mistral window GGUF", lengths=(150, 37))
    report(capsys, f"mistral window GGUF: hidden {hidden:.2e}, logits {logits:.2e}")
    tokens, _ = greedy(loaded, PROMPTS)
    assert tokens == expected


def test_ngram_speculation_keeps_the_tokens(pair, expected):
    """Verify rows attend each within its own window, rejected drafts roll back before blocks are freed:
    n-gram speculation (its drafts accepted on a repetitive prompt) gives HF's tokens."""
    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.spec_decode.config import SpeculativeConfig

    _, loaded, _ = pair
    speculative = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    config = EngineConfig(num_blocks=64, block_size=BLOCK, metrics_interval_s=3600.0)
    engine = LLMEngine(loaded, config, speculative=speculative)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
    log = EventLog(engine)
    done = run(engine)
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == expected
    assert any(s.num_draft for e in log.of(ev.StepScheduled) for s in e.decode), "no draft was ever verified"
    assert_all_blocks_free(engine)
