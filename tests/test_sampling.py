"""Sampling parameters and the batched sampler."""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.sampling import filters
from minivllm.sampling.filters import apply_min_p, apply_top_k_top_p, apply_top_k_top_p_min_p, inverse_cdf_draw
from minivllm.sampling.params import SamplingParams
from minivllm.sampling.sampler import Sampler, SamplingRow, apply_penalties, pad_token_lists

V = 32


def row(params=None, prompt=(1, 2, 3), output=(), generator=None, eos=None, **kw) -> SamplingRow:
    params = params or SamplingParams(**kw)
    return SamplingRow(
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=generator,
        eos_token_id=eos,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -1.0}, "temperature must be a finite number >= 0, got -1.0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0, got inf"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be in [-2, 2], got nan"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be -1 or 0 (disabled) or >= 1, got -2"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0, got 0.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number > 0, got inf"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"n": 0}, "n must be an integer >= 1, got 0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1 or None, got 0"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens=10, got 20"),
        ({"logprobs": 21}, "logprobs must be in [0, 20] or None, got 21"),
        ({"logprobs": -1}, "logprobs must be in [0, 20] or None, got -1"),
        ({"seed": 1.5}, "seed must be an integer in [0, 9223372036854775807]"),
        ({"seed": -1}, "seed must be an integer in [0, 9223372036854775807]"),
        ({"seed": 2**64 - 1, "n": 2}, "seed must be an integer in [0, 9223372036854775806]"),
        ({"seed": 2**63 - 1, "n": 2}, "seed must be an integer in [0, 9223372036854775806]"),
        ({"use_beam_search": True, "length_penalty": 1e308}, "length_penalty must be in [-10, 10], got 1e+308"),
        ({"use_beam_search": True, "length_penalty": float("nan")}, "length_penalty must be in [-10, 10]"),
        ({"use_beam_search": True, "beam_width": 0}, "beam_width must be an integer >= 1, got 0"),
        ({"use_beam_search": True, "n": 3, "beam_width": 2}, "n must be <= beam_width=2 for beam search, got 3"),
        ({"stop": ["ok", ""]}, "stop must not contain empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers"),
    ],
)
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert message in str(exc.value)


def test_the_largest_valid_seed_seeds_every_sample():
    p = SamplingParams(seed=2**63 - 3, n=3)
    for index in range(p.n):  # what the engine does per sample; an overflow here would fail mid-step
        torch.Generator().manual_seed(p.seed + index)


def test_validate_catches_later_mutation():
    p = SamplingParams()
    p.top_k = -5
    with pytest.raises(ValueError, match="top_k"):
        p.validate()


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.is_greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(top_k=-1).effective_top_k == 0
    beam = SamplingParams(n=3, use_beam_search=True, temperature=0.0)
    assert beam.beam_width == 3 and not beam.is_greedy
    assert SamplingParams(n=2, use_beam_search=True, beam_width=4).beam_width == 4


# --------------------------------------------------------------------------- filters


def test_top_k_never_outside_top_k():
    torch.manual_seed(0)
    logits = torch.randn(V)
    k = 5
    allowed = set(logits.topk(k).indices.tolist())
    n = 3000
    out = Sampler()(logits.expand(n, V).clone(), [row(top_k=k) for _ in range(n)])
    drawn = set(out.token_ids)
    assert drawn <= allowed
    assert drawn == allowed  # and every one of them does get drawn


def test_top_p_never_outside_nucleus():
    torch.manual_seed(1)
    logits = torch.randn(V) * 2
    p = 0.7
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    n_keep = int((cum < p).sum()) + 1  # smallest prefix with mass >= p
    nucleus = set(order[:n_keep].tolist())
    assert 1 < len(nucleus) < V
    n = 3000
    out = Sampler()(logits.expand(n, V).clone(), [row(top_p=p) for _ in range(n)])
    drawn = set(out.token_ids)
    assert drawn <= nucleus
    assert drawn == nucleus


def test_min_p_threshold():
    torch.manual_seed(2)
    logits = torch.randn(V)
    mp = 0.2
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= mp * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < V
    n = 3000
    out = Sampler()(logits.expand(n, V).clone(), [row(min_p=mp) for _ in range(n)])
    assert set(out.token_ids) == allowed


def test_filter_helpers_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 0.0, 10.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    k = torch.tensor([2, 4, 4])
    p = torch.tensor([1.0, 0.5, 1.0])
    out = apply_top_k_top_p(logits, k, p)
    ninf = float("-inf")
    assert out[0].tolist() == [ninf, 4.0, 3.0, ninf]
    assert out[1].tolist() == [ninf, ninf, 10.0, ninf]  # nucleus of one token
    assert out[2].tolist() == logits[2].tolist()
    assert torch.equal(logits[0], torch.tensor([1.0, 4.0, 3.0, 2.0]))  # out of place
    mp = apply_min_p(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), torch.tensor([0.5]))
    assert torch.isinf(mp[0, 2:]).all() and torch.isfinite(mp[0, :2]).all()
    combined = apply_top_k_top_p_min_p(logits, torch.tensor([3, 3, 3]), None, torch.tensor([0.0, 0.0, 0.3]))
    assert torch.isinf(combined).sum(dim=1).tolist() == [1, 0, 2]  # row 1: ties at the k-th value kept
    assert apply_top_k_top_p(logits, None, None) is logits


def test_sampling_follows_temperature_scaled_softmax():
    torch.manual_seed(3)
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    temp = 0.7
    n = 20000
    out = Sampler()(logits.expand(n, 4).clone(), [row(temperature=temp) for _ in range(n)])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).double() / n
    expected = torch.softmax(logits.double() / temp, -1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_inverse_cdf_draw_distribution_with_generator():
    probs = torch.tensor([[0.1, 0.6, 0.0, 0.3]]).expand(6000, 4).contiguous()
    g = seeded(7)
    tokens = inverse_cdf_draw(probs, [g] + [None] * 5999)
    freq = torch.bincount(tokens, minlength=4).double() / 6000
    assert freq[2] == 0  # a token without probability is never drawn
    assert torch.allclose(freq, probs[0].double(), atol=0.03)


def test_inverse_cdf_draw_keeps_the_chance_of_a_tiny_probability():
    """float64 cumulative sums: a token of probability 1e-9 next to one of ~1 is still reachable (a
    float32 sum would swallow it), and a draw at the very top of the range lands on a real token."""
    probs = torch.tensor([[1.0, 1e-9, 0.0]])
    cumulative = probs.double().cumsum(-1)
    assert cumulative[0, 1] > cumulative[0, 0]
    g = seeded(1)
    assert inverse_cdf_draw(probs, [g]).tolist() == [0]
    torch.manual_seed(0)
    rigged = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    original = filters._uniforms
    filters._uniforms = lambda gens, device: torch.full((len(gens),), 1.0, dtype=torch.float64)
    try:
        assert inverse_cdf_draw(rigged, [None]).tolist() == [1]  # u * total == total: not the empty tail
    finally:
        filters._uniforms = original


def test_a_seeded_draw_depends_on_its_own_generator_only():
    probs = torch.softmax(torch.randn(5, 1000), -1)
    alone = inverse_cdf_draw(probs[2:3], [seeded(11)])
    torch.manual_seed(123)
    in_batch = inverse_cdf_draw(probs, [None, None, seeded(11), None, seeded(5)])
    assert in_batch[2] == alone[0]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_by_candidates_equals_the_sorted_nucleus(temperature, top_p, monkeypatch):
    """The nucleus found among the top candidates (widening when it does not close there) is the one
    a full sort gives, on a vocabulary large enough that flat rows need every widening step."""
    monkeypatch.setattr(filters, "CANDIDATE_WIDTHS", (8, 64))
    torch.manual_seed(5)
    logits = torch.randn(6, 2000) * torch.tensor([[0.1], [1.0], [3.0], [8.0], [0.5], [2.0]]) / temperature
    out = apply_top_k_top_p(logits, None, torch.full((6,), top_p))
    for i in range(6):
        probs = torch.softmax(logits[i].double(), -1)
        ordered, order = probs.sort(descending=True)
        size = int((ordered.cumsum(0) - ordered < top_p).sum())
        expected = set(order[:size].tolist())
        assert set(torch.isfinite(out[i]).nonzero().flatten().tolist()) == expected


def test_top_p_keeps_every_token_tied_at_the_boundary():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, -2.0]])
    probs = torch.softmax(logits, -1)
    p = float(probs[0, 0] + probs[0, 1] / 2)  # the nucleus ends inside the tie
    out = apply_top_k_top_p(logits, None, torch.tensor([p]))
    assert torch.isfinite(out).tolist() == [[True, True, True, True, False]]


def test_top_k_beyond_the_candidates_then_top_p(monkeypatch):
    monkeypatch.setattr(filters, "CANDIDATE_WIDTHS", (4,))
    logits = torch.arange(100, dtype=torch.float32).flip(0).unsqueeze(0) / 10
    out = apply_top_k_top_p(logits, torch.tensor([50]), torch.tensor([1.0]))
    assert int(torch.isfinite(out).sum()) == 50
    renorm = torch.softmax(logits[0, :50].double(), -1)
    size = int((renorm.cumsum(0) - renorm < 0.8).sum())
    out = apply_top_k_top_p(logits, torch.tensor([50]), torch.tensor([0.8]))
    assert int(torch.isfinite(out).sum()) == size


# --------------------------------------------------------------------------- greedy


def test_tiny_temperature_is_greedy_argmax():
    torch.manual_seed(4)
    logits = torch.randn(8, V)
    out = Sampler()(logits, [row(temperature=1e-6) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    # a small but non-greedy temperature makes the argmax overwhelmingly likely too
    out = Sampler()(logits * 10, [row(temperature=1e-3) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    torch.manual_seed(5)
    logits = torch.randn(6, V)
    rows = [row(temperature=0.0), row(top_k=1), row(temperature=0.0), row(), row(temperature=0.0), row(top_k=3)]
    out = Sampler()(logits, rows)
    arg = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 1, 2, 4)] == [arg[i] for i in (0, 1, 2, 4)]
    assert out.token_ids[5] in logits[5].topk(3).indices.tolist()


def test_half_precision_logits_are_cast():
    logits = torch.randn(3, V).half()
    out = Sampler()(logits, [row(temperature=0.0, logprobs=2) for _ in range(3)])
    ref = torch.log_softmax(logits.float(), -1)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == pytest.approx(ref.max(-1).values.tolist(), abs=1e-5)


# --------------------------------------------------------------------------- seeds


def _run_steps(rows_factory, logits_seq, index):
    """Run a few sampler steps with persistent generators; return the tokens of row `index`."""
    rows = rows_factory()
    sampler = Sampler()
    toks = []
    for logits in logits_seq:
        out = sampler(logits[: len(rows)].clone(), rows)
        toks.append(out.token_ids[index])
        for r, t in zip(rows, out.token_ids):
            r.output_token_ids = list(r.output_token_ids) + [t]
    return toks


def test_seeded_row_is_reproducible_and_batch_independent():
    torch.manual_seed(6)
    steps = [torch.randn(5, V) for _ in range(12)]
    # the seeded row sees the same logits in every configuration (row 0 of each step)
    p = SamplingParams(seed=1234, top_p=0.95)

    def alone():
        return [row(p, generator=seeded(1234))]

    def with_others():
        return [
            row(p, generator=seeded(1234)),
            row(seed=99, generator=seeded(99)),
            row(),
            row(temperature=0.0),
            row(top_k=4),
        ]

    def other_position():
        rs = with_others()
        return [rs[2], rs[0], rs[1]]

    a = _run_steps(alone, steps, 0)
    torch.manual_seed(123)  # the unseeded rows' shared draw must not matter
    b = _run_steps(with_others, steps, 0)
    steps_moved = [torch.cat([s[1:2], s[0:1], s[2:]]) for s in steps]  # keep row logits with the row
    c = _run_steps(other_position, steps_moved, 1)
    assert a == b == c
    # a different seed gives a different stream
    d = _run_steps(lambda: [row(p, generator=seeded(4321))], steps, 0)
    assert d != a


def test_unseeded_rows_differ_between_calls():
    logits = torch.zeros(1, 1000)
    outs = {Sampler()(logits, [row()]).token_ids[0] for _ in range(10)}
    assert len(outs) > 1


# --------------------------------------------------------------------------- penalties


def naive_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        c = output.count(t)
        out[t] -= freq * c + pres
    return out


def test_penalties_match_naive_reference():
    torch.manual_seed(8)
    cases = [
        ([1, 2, 3, 3], [3, 4, 4, 4, 7], 1.3, 0.5, 0.25),
        ([5], [], 0.8, 1.0, 1.0),
        ([9, 10, 11, 12, 13, 14, 15], [0, 0, 31], 1.0, -0.7, 1.5),
        ([2], [2, 2, 20], 2.0, 0.0, -2.0),
    ]
    logits = torch.randn(len(cases), V) * 3
    res = apply_penalties(
        logits,
        pad_token_lists([c[0] for c in cases], V),
        pad_token_lists([c[1] for c in cases], V),
        torch.tensor([c[2] for c in cases]),
        torch.tensor([c[3] for c in cases]),
        torch.tensor([c[4] for c in cases]),
    )
    for i, (prompt, output, rep, freq, pres) in enumerate(cases):
        ref = naive_penalties(logits[i], prompt, output, rep, freq, pres)
        assert torch.allclose(res[i], ref, atol=1e-6), i


def test_sampler_applies_penalties_only_to_rows_that_ask():
    # greedy rows expose the processed logits through their argmax
    logits = torch.tensor([[5.0, 4.9, 1.0, -1.0], [5.0, 4.9, 1.0, -1.0], [5.0, 4.9, 1.0, -1.0]])
    rows = [
        row(temperature=0.0, repetition_penalty=1.1, prompt=[0]),  # 5/1.1 < 4.9 -> token 1
        row(temperature=0.0, prompt=[0]),  # no penalty -> token 0
        row(temperature=0.0, frequency_penalty=0.05, presence_penalty=0.0, prompt=[1], output=[0, 0, 0]),  # 4.85
    ]
    out = Sampler()(logits.clone(), rows)
    assert out.token_ids == [1, 0, 1]
    # presence penalty pushes a negative logit further down, repetition penalty multiplies it
    logits2 = torch.tensor([[-1.0, -1.05, -3.0, -4.0]])
    assert Sampler()(logits2, [row(temperature=0.0, repetition_penalty=1.2, prompt=[0])]).token_ids == [1]
    assert Sampler()(logits2, [row(temperature=0.0, presence_penalty=0.1, output=[0])]).token_ids == [1]


def test_sampler_penalties_against_naive_reference_greedy_batch():
    torch.manual_seed(9)
    n = 16
    logits = torch.randn(n, V) * 2
    rows, refs = [], []
    for i in range(n):
        prompt = torch.randint(0, V, (int(torch.randint(1, 10, ())),)).tolist()
        output = torch.randint(0, V, (int(torch.randint(0, 12, ())),)).tolist()
        rep = float(torch.empty(()).uniform_(0.5, 2.0)) if i % 3 else 1.0
        freq = float(torch.empty(()).uniform_(-1, 1)) if i % 2 else 0.0
        pres = float(torch.empty(()).uniform_(-1, 1)) if i % 4 else 0.0
        rows.append(
            row(
                temperature=0.0,
                prompt=prompt,
                output=output,
                repetition_penalty=rep,
                frequency_penalty=freq,
                presence_penalty=pres,
            )
        )
        refs.append(naive_penalties(logits[i], prompt, output, rep, freq, pres))
    out = Sampler()(logits.clone(), rows)
    assert out.token_ids == [int(r.argmax()) for r in refs]


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]]).expand(4, 5).clone()
    eos = 2
    rows = [
        row(temperature=0.0, min_tokens=3, output=[4], eos=eos),  # eos masked -> 3
        row(temperature=0.0, min_tokens=3, stop_token_ids=[3], output=[4], eos=eos),  # eos and 3 masked -> 4
        row(temperature=0.0, min_tokens=1, output=[4], eos=eos),  # min reached -> eos allowed
        row(temperature=0.0, min_tokens=3, ignore_eos=True, output=[], eos=eos),  # ignore_eos: not masked
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids == [3, 4, 2, 2]
    # logprobs still come from the raw distribution
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0] == pytest.approx(float(raw[3]))
    # sampled rows never pick a masked token either
    n = 500
    many = Sampler()(logits[:1].expand(n, 5).clone(), [row(min_tokens=2, eos=eos) for _ in range(n)])
    assert eos not in many.token_ids


# --------------------------------------------------------------------------- logprobs


def test_logprobs_match_raw_log_softmax():
    torch.manual_seed(10)
    logits = torch.randn(4, V) * 2
    rows = [
        row(logprobs=5, temperature=0.5, repetition_penalty=1.5, prompt=[0, 1, 2]),
        row(logprobs=0),
        row(temperature=0.0, logprobs=20, top_k=3),
        row(),
    ]
    out = Sampler()(logits.clone(), rows)
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(ref[i, t]), abs=1e-5)
    assert out.top_logprobs is not None
    assert out.top_logprobs[1] == [] and out.top_logprobs[3] == []
    for i, n in ((0, 5), (2, 20)):
        vals, ids = ref[i].topk(n)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-5)
    assert math.isclose(
        sum(math.exp(lp) for _, lp in out.top_logprobs[2]), float(ref[2].exp().topk(20).values.sum()), rel_tol=1e-5
    )


def test_an_all_greedy_batch_takes_the_fused_pick_with_torchs_tokens_and_logprobs(monkeypatch):
    """All rows greedy, nothing processed: one native pass gives argmax and log-sum-exp (where the kernels
    are built); tokens equal torch's argmax, log-probs and top-N log_softmax's. A logit bias changes what
    the argmax reads, so that batch keeps torch's argmax over the processed logits."""
    from minivllm.kernels.cpu import native

    calls = []
    fused = native.argmax_logsumexp
    monkeypatch.setattr(native, "argmax_logsumexp", lambda x: calls.append(x.shape) or fused(x))
    torch.manual_seed(11)
    logits = torch.randn(6, V) * 3
    ref = torch.log_softmax(logits, -1)
    out = Sampler()(logits.clone(), [row(temperature=0.0, logprobs=3 if i % 2 else 0) for i in range(6)])
    assert calls == ([(6, V)] if native.reduces_logits(logits) else [])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == pytest.approx(ref.max(-1).values.tolist(), abs=1e-5)
    assert [t for t, _ in out.top_logprobs[1]] == ref[1].topk(3).indices.tolist()
    assert [lp for _, lp in out.top_logprobs[1]] == pytest.approx(ref[1].topk(3).values.tolist(), abs=1e-5)
    calls.clear()
    low = int(logits[0].argmin())
    biased = Sampler()(
        logits.clone(), [row(temperature=0.0, logit_bias={low: 100.0})] + [row(temperature=0.0) for _ in range(5)]
    )
    assert calls == [] and biased.token_ids[0] == low
    assert biased.logprobs[0] == pytest.approx(float(ref[0, low]), abs=1e-5)  # of the raw distribution


def test_no_top_logprobs_when_not_requested():
    out = Sampler()(torch.randn(2, V), [row(), row(logprobs=0)])
    assert out.top_logprobs is None
    assert len(out.logprobs) == 2 and all(lp <= 0 for lp in out.logprobs)


def test_empty_batch_and_shape_check():
    out = Sampler()(torch.empty(0, V), [])
    assert out.token_ids == [] and out.logprobs == []
    with pytest.raises(ValueError):
        Sampler()(torch.randn(2, V), [row()])


# --------------------------------------------------------------------------- against HF generate()'s processors


@pytest.mark.parametrize("preset", ["temperature 0.7", "balanced", "creative"])
@pytest.mark.parametrize("spread", [1.0, 4.0])
def test_truncation_keeps_exactly_the_tokens_hf_warpers_keep(preset, spread):
    """The oracle: HF's repetition penalty, temperature, top-k, top-p and min-p warpers, in generate()'s
    order, leave finite exactly the tokens our sampler can draw; the penalised logits agree too."""
    from minivllm.bench.sampler import PRESETS, hf_processors, padded_history

    torch.manual_seed(21)
    rows_n, vocab = 12, 5000
    logits = torch.randn(rows_n, vocab) * spread * torch.linspace(0.5, 2.0, rows_n).unsqueeze(1)
    history = [torch.randint(0, vocab, (int(n),)).tolist() for n in torch.randint(5, 300, (rows_n,))]
    params = SamplingParams(**PRESETS[preset])
    rows = [row(params, prompt=h) for h in history]
    processed = Sampler().processed(logits, rows)
    hf = hf_processors(params)
    hf_penalised = hf[0](padded_history(history), logits.clone()) if params.repetition_penalty != 1.0 else logits
    assert torch.allclose(processed, hf_penalised, atol=1e-6)
    ours = torch.isfinite(Sampler.truncated(processed, rows))
    theirs = torch.isfinite(hf(padded_history(history), logits.clone()))
    assert torch.equal(ours, theirs)
    truncates = params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
    assert 0 < int(ours.sum()) < rows_n * vocab if truncates else bool(ours.all())


def test_sparse_penalties_equal_the_dense_formula():
    torch.manual_seed(22)
    vocab = 50
    logits = torch.randn(3, vocab)
    prompt = pad_token_lists([[1, 2, 2, 7], [], [4]], vocab)
    output = pad_token_lists([[2, 9, 9, 9], [3, 3], []], vocab)
    rep, freq, pres = torch.tensor([1.3, 1.0, 2.0]), torch.tensor([0.5, 0.25, 0.0]), torch.tensor([0.1, 0.7, 0.0])
    original = logits.clone()
    out = apply_penalties(logits, prompt, output, rep, freq, pres)
    expected = logits.clone()
    for r, (p_ids, o_ids) in enumerate([([1, 2, 2, 7], [2, 9, 9, 9]), ([], [3, 3]), ([4], [])]):
        for t in set(p_ids) | set(o_ids):
            v = logits[r, t]
            v = v / rep[r] if v > 0 else v * rep[r]
            count = o_ids.count(t)
            expected[r, t] = v - freq[r] * count - pres[r] * (count > 0)
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.equal(logits, original)  # out of place


def test_allowed_token_ids_leave_only_those_tokens_per_row():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[7, 9])
    rows = [
        SamplingRow(allowed, [1], []),
        SamplingRow(SamplingParams(temperature=0.0), [1], []),
        SamplingRow(SamplingParams(temperature=1.0, allowed_token_ids=[3], seed=1), [1], []),
    ]
    processed = Sampler().processed(logits, rows)
    assert torch.isfinite(processed[0]).nonzero().flatten().tolist() == [7, 9]
    assert torch.equal(processed[1], logits[1])  # a row that asks for nothing is untouched
    assert processed[0, 7] == logits[0, 7] and processed[0, 9] == logits[0, 9]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == (7 if logits[0, 7] > logits[0, 9] else 9) and out.token_ids[2] == 3


def test_bad_words_ban_a_words_last_token_only_after_the_rest_of_it():
    params = SamplingParams(temperature=0.0, bad_words=["x"])
    params.bad_words_token_ids = [[5], [8, 9, 4]]  # a one-token word, and a three-token one
    logits = torch.zeros(3, 12)
    rows = [SamplingRow(params, [1], []), SamplingRow(params, [1], [2, 8, 9]), SamplingRow(params, [1], [8, 2, 9])]
    processed = Sampler().processed(logits, rows)
    banned = [torch.isinf(row).nonzero().flatten().tolist() for row in processed]
    assert banned == [[5], [4, 5], [5]]  # 4 only where the output ends with 8, 9
    assert params.reads_output_tokens  # the engine hands the sampler each row's output for this


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids must be a non-empty list"),
        (dict(bad_words=[" "]), "bad_words must hold non-blank strings"),
        (dict(bad_words=["w"] * 1025), "bad_words must be a list of at most 1024"),
    ],
)
def test_token_list_fields_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
