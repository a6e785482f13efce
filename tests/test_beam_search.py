"""BeamSearchState against Hugging Face ``generate(num_beams=k, do_sample=False)``.

A tiny random Llama is driven two ways: by HF ``generate`` and by our state machine, where the
test itself plays the engine (full forward passes on the live beams, no KV cache). Both use
``use_cache=False`` and the same batch shapes (the prompt is run as ``k`` copies on the first
step, like HF does), so the logits are bitwise identical and the outputs must match token for
token.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from minivllm.sampling.beam_search import BeamSearchState

VOCAB = 128
PAD = 0
PROMPTS = [
    [1, 17, 42, 99, 7],
    [1, 3, 3, 3],
    [1, 88, 12, 64, 23, 101, 45, 9, 77],
]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
        initializer_range=0.1,  # peakier than the 0.02 default: fewer near-ties, EOS matters
    )
    m = LlamaForCausalLM(cfg).eval()
    # The model is tiny: one thread is much faster than two contending ones.
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield m
    torch.set_num_threads(old_threads)


def hf_beam_search(model, prompt, k, max_new, length_penalty, eos):
    gc = GenerationConfig(
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        early_stopping=False,
        length_penalty=length_penalty,
        max_new_tokens=max_new,
        min_new_tokens=0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        temperature=1.0,
        top_k=None,
        top_p=None,
        eos_token_id=eos,
        pad_token_id=PAD,
        bos_token_id=1,
        use_cache=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=gc)
    seqs = out.sequences[:, len(prompt) :].tolist()
    hf_beam_search.last_steps = len(out.scores)  # one entry per decoding step
    return seqs, out.sequences_scores.tolist()


def our_beam_search(model, prompt, k, max_new, length_penalty, eos, num_return=None):
    state = BeamSearchState(
        beam_width=k,
        length_penalty=length_penalty,
        eos_token_id=eos,
        max_tokens=max_new,
        prompt_len=len(prompt),
        num_return=num_return or k,
    )
    beams = torch.tensor([prompt])
    steps = 0
    with torch.no_grad():
        while True:
            batch = beams if beams.shape[0] == k else beams.expand(k, -1)  # HF runs k prompt copies
            logits = model(batch, attention_mask=torch.ones_like(batch), logits_to_keep=1).logits[:, -1, :].float()
            logprobs = torch.log_softmax(logits, dim=-1)[: beams.shape[0]]
            nxt = state.step(logprobs)
            steps += 1
            if not nxt:
                break
            assert len(nxt) == k
            parents = torch.tensor([p for p, _ in nxt])
            tokens = torch.tensor([[t] for _, t in nxt])
            beams = torch.cat([beams[parents], tokens], dim=1)
            # the state's own view of the live beams agrees with the engine's
            assert [list(map(int, b[len(prompt) :])) for b in beams] == state.live_beams
    with pytest.raises(RuntimeError, match="already finished"):  # a finished search stays finished
        state.step(logprobs)
    assert steps <= max_new
    our_beam_search.last_steps = steps
    return state.results()


def assert_same(hf, ours, eos):
    hf_seqs, hf_scores = hf
    assert len(ours) == len(hf_seqs)
    for (toks, score), hseq, hscore in zip(ours, hf_seqs, hf_scores):
        # HF right-pads shorter hypotheses up to the longest returned one, with
        # `pad_token_id or eos_token_id` -- pad id 0 is falsy, so here it pads with EOS.
        fill = (PAD or eos) if eos is not None else -1
        assert hseq[: len(toks)] == toks
        assert all(t == fill for t in hseq[len(toks) :])
        if len(toks) < len(hseq):
            assert toks[-1] == eos
        assert score == hscore  # same float32 ops in the same order


_EOS_CACHE: dict = {}


def _eos_that_fires(model, prompt, k, max_new, length_penalty):
    """Pick an EOS id that ends at least one returned hypothesis early.

    Candidates are the tokens of the no-EOS beam search output; only our implementation is
    used for the choice, the comparison with HF comes afterwards.
    """
    key = (tuple(prompt), k, max_new, length_penalty)
    if key not in _EOS_CACHE:
        seqs, _ = hf_beam_search(model, prompt, k, max_new, 1.0, eos=None)
        candidates = list(dict.fromkeys(t for s in seqs for t in s))
        _EOS_CACHE[key] = candidates[0]
        for eos in candidates:
            ours = our_beam_search(model, prompt, k, max_new, length_penalty, eos)
            if any(len(toks) < max_new for toks, _ in ours):
                _EOS_CACHE[key] = eos
                break
    return _EOS_CACHE[key]


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_matches_hf_with_early_eos(model, k, length_penalty):
    max_new = 8
    early = stopped_early = 0
    for prompt in PROMPTS[:2]:
        eos = _eos_that_fires(model, prompt, k, max_new, length_penalty)
        hf = hf_beam_search(model, prompt, k, max_new, length_penalty, eos)
        ours = our_beam_search(model, prompt, k, max_new, length_penalty, eos)
        assert_same(hf, ours, eos)
        assert our_beam_search.last_steps == hf_beam_search.last_steps
        early += sum(1 for toks, _ in ours if len(toks) < max_new)
        stopped_early += our_beam_search.last_steps < max_new
    if length_penalty <= 1.0:  # a strong length penalty (2.0) favours the long hypotheses
        assert early > 0, "test setup: expected at least one hypothesis ended by EOS"
    if (k, length_penalty) == (2, 1.0):
        # here the "no live beam can beat the worst kept hypothesis" heuristic ends the
        # search before max_tokens, after the same number of steps as HF
        assert stopped_early > 0


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (3, 0.5), (4, 2.0), (3, -1.0)])
def test_matches_hf_eos_config_token(model, k, length_penalty):
    # the model's configured EOS id (rarely or never generated) and a longer prompt
    for prompt in PROMPTS:
        hf = hf_beam_search(model, prompt, k, 6, length_penalty, eos=2)
        ours = our_beam_search(model, prompt, k, 6, length_penalty, eos=2)
        assert_same(hf, ours, 2)
        assert our_beam_search.last_steps == hf_beam_search.last_steps


def test_matches_hf_without_eos(model):
    prompt = PROMPTS[2]
    hf = hf_beam_search(model, prompt, 3, 5, 1.0, eos=None)
    ours = our_beam_search(model, prompt, 3, 5, 1.0, eos=None)
    assert all(len(t) == 5 for t, _ in ours)
    assert_same(hf, ours, None)


def test_num_return_subset_and_max_tokens_one(model):
    prompt = PROMPTS[0]
    hf_seqs, hf_scores = hf_beam_search(model, prompt, 4, 6, 1.0, eos=2)
    ours = our_beam_search(model, prompt, 4, 6, 1.0, eos=2, num_return=2)
    assert len(ours) == 2
    assert_same((hf_seqs[:2], hf_scores[:2]), ours, 2)

    hf = hf_beam_search(model, prompt, 3, 1, 1.0, eos=2)
    ours = our_beam_search(model, prompt, 3, 1, 1.0, eos=2)
    assert all(len(t) == 1 for t, _ in ours)
    assert_same(hf, ours, 2)


def test_state_machine_basics():
    # Hand-made distributions: beam search over a 4-token vocab, EOS = 3.
    state = BeamSearchState(beam_width=2, length_penalty=1.0, eos_token_id=3, max_tokens=3, prompt_len=5, num_return=2)
    lp = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    nxt = state.step(lp)
    # EOS (best) becomes a finished hypothesis, the next two tokens are the live beams
    assert nxt == [(0, 2), (0, 1)]
    assert state.results() == [([3], pytest.approx(float(lp[0, 3])))]
    lp2 = torch.log(torch.tensor([[0.97, 0.01, 0.01, 0.01], [0.97, 0.01, 0.01, 0.01]]))
    nxt = state.step(lp2)
    assert nxt == [(0, 0), (1, 0)]
    nxt = state.step(torch.log(torch.full((2, 4), 0.25)))
    assert nxt == []
    res = state.results()
    assert len(res) == 2 and res[0][1] >= res[1][1]
    with pytest.raises(RuntimeError):
        state.step(lp2)
    with pytest.raises(ValueError):
        BeamSearchState(beam_width=2, length_penalty=1.0, eos_token_id=3, max_tokens=3, prompt_len=5, num_return=3)
