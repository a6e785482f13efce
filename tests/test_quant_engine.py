"""The engine on quantized weights: the embedded model at its default 4-bit precision against the
fp32-dequantized model, and int8/int4 through prefix caching, beams, n > 1 and preemption.

Tolerances: the 4-bit default reads exactly the GGUF's Q4_1 values, so its only error against the
fp32-dequantized model is (a) the Q8_0 embedding/head requantized per channel and (b) activations
rounded to bf16 where the chooser picks the bf16 kernels (a CPU-dependent choice); the head's 64
highest logits per row are exact either way. Measured on the AVX2 dev box: KL(fp32 || default)
0.0018 nats/token, top-1 agreement 97.1% on the ~120 positions of this test (0.0025 and 94.3%
before the head's exact top logits). The bounds below (KL < 0.02, top-1 > 90%) leave
room for another CPU's kernel choice and are far from a real defect (a wrong block layout, scale or
permutation gives KL > 1, top-1 < 60%).
"""

from __future__ import annotations

import pytest
import torch

from engine_utils import assert_all_blocks_free, chat_ids, first_part_at_a_near_tie, make_engine, run
from minivllm.engine.scoring import forward_prefills
from minivllm.kernels.cpu import native
from minivllm.loader import load_model
from minivllm.quant.linear import QuantLinear
from minivllm.quant.policy import QuantConfig
from minivllm.sampling.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "How do I boil an egg?",
]
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def greedy_alone_and_batched(loaded, prompts, params):
    alone = []
    for ids in prompts:
        engine = make_engine(loaded, num_blocks=64)
        engine.add_request("a", prompt_token_ids=ids, params=params)
        alone.append(run(engine)["a"].outputs[0])
    engine = make_engine(loaded, num_blocks=256)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    outs = run(engine)
    assert_all_blocks_free(engine)
    return alone, [outs[f"r{i}"].outputs[0] for i in range(len(prompts))]


def test_default_runs_the_gguf_in_4_bits_within_30_percent_of_fp32_memory(embedded_model_q4):
    report = embedded_model_q4.quant
    assert report.mode.startswith("int4 g32")
    assert report.ratio <= 0.30, f"{report.weight_bytes / 2**20:.0f} MiB is {report.ratio:.0%} of fp32"
    layers = [m for m in embedded_model_q4.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * 30 + 1  # qkv, o, gate_up, down per layer + the tied head


def test_default_4_bit_logits_stay_close_to_fp32_dequantized(embedded_model, embedded_model_q4, capsys):
    tok = embedded_model.tokenizer
    text = tok.encode(
        "The history of the present King of Great Britain is a history of repeated injuries "
        "and usurpations, all having in direct object the establishment of an absolute Tyranny."
    )
    seqs = [text, chat_ids(tok, QUESTIONS[0])]
    ref = torch.cat(forward_prefills(embedded_model, seqs)).log_softmax(-1)
    got = torch.cat(forward_prefills(embedded_model_q4, seqs)).log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(f"\n[quant] default 4-bit vs fp32: KL mean {kl.mean():.5f}, max {kl.max():.4f}, top-1 {top1:.1%}")
    assert kl.mean() < 0.02 and top1 > 0.90


def greedy_first_differences(reference, loaded, prompts) -> list[int | None]:
    """Per prompt: the index of the first token where `loaded` and `reference` differ (None: equal)."""
    params = SamplingParams(temperature=0.0, max_tokens=64)
    firsts = []
    for ids in prompts:
        outs = []
        for model in (reference, loaded):
            engine = make_engine(model, num_blocks=64)
            engine.add_request("g", prompt_token_ids=ids, params=params)
            outs.append(run(engine)["g"].outputs[0].token_ids)
        firsts.append(
            next(
                (i for i, (a, b) in enumerate(zip(*outs)) if a != b),
                None if len(outs[0]) == len(outs[1]) else min(map(len, outs)),
            )
        )
    return firsts


def test_4_bit_greedy_tracks_fp32_on_chat_prompts(embedded_model, capsys):
    """Greedy decoding amplifies any rounding difference at a near-tie, so token identity over 64
    tokens measures near-exactness, not quality (KL does that). With the exact kernels (fp32
    activations) the only difference left is the per-channel int8 head: measured 3/5 prompts
    identical, the others first differing at tokens 6 and 23. A wrong block layout, permutation or
    scale differs from token 0 on every prompt."""
    prompts = [chat_ids(embedded_model.tokenizer, q) for q in QUESTIONS]
    exact = load_model(None, quantization=QuantConfig("auto", kernel="exact"))
    exact_firsts = greedy_first_differences(embedded_model, exact, prompts)
    with capsys.disabled():  # the default kernels' agreement is in `minivllm bench quality`
        print(
            f"\n[quant] first greedy difference vs fp32 over 64 tokens (None = identical), exact kernels: "
            f"{exact_firsts}"
        )
    assert sum(f is None for f in exact_firsts) >= 3
    assert all(f is None or f >= 4 for f in exact_firsts)


def test_torchs_bf16_kernels_answer_as_fp32_where_bf16_logits_used_to_tie(embedded_model):
    """With a plain bf16 LM head the 4-bit model answered this with "L'Étoile, la Marseillaise, ...":
    two first tokens tied at bf16's logit resolution. The head's exact top logits (ExactTopLogits) give
    fp32's answer. (The int8-activation kernels flip this near-tie inside the layers: README,
    "quality"; this test pins torch's bf16 kernels, the path the exact head was built for.)"""
    answers = []
    bf16 = load_model(None, quantization=QuantConfig("auto", kernel="bf16"))
    for loaded in (embedded_model, bf16):
        engine = make_engine(loaded, num_blocks=64)
        engine.add_request(
            "q",
            prompt_token_ids=chat_ids(loaded.tokenizer, QUESTIONS[0]),
            params=SamplingParams(temperature=0.0, max_tokens=12),
        )
        answers.append(loaded.tokenizer.decode(run(engine)["q"].outputs[0].token_ids, skip_special_tokens=True))
    assert answers[1] == answers[0] and "Paris" in answers[0], answers


@pytest.mark.slow
@pytest.mark.parametrize("forced", ["bf16", "fp32"])
def test_one_kernel_for_every_row_count_makes_batch_and_alone_identical(forced):
    """Each kernel computes each row independently, so when one kernel serves 1 row and 5 rows the
    greedy output of a request alone equals the same request in a batch, token for token."""
    loaded = load_model(None, quantization=QuantConfig("auto", kernel=forced))
    assert {k.name.split("/")[1] for m in loaded.model.modules() if isinstance(m, QuantLinear) for _, k in m.plan} == {
        forced
    }
    prompts = [chat_ids(loaded.tokenizer, q) for q in QUESTIONS[:3]]
    alone, batched = greedy_alone_and_batched(
        loaded, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched]


@pytest.mark.slow
def test_int8_activation_kernels_part_batch_from_alone_only_at_near_ties(capsys):
    """Our kernels also compute each row alone (bit for bit: test_native_kernels.py), but a batch's
    attention sums in another order than a request's alone, and int8 activation rounding turns that
    last-bit difference into a whole rounding step more often than bf16 does. So where a batched run
    parts from the alone run, it must take the alone run's runner-up within engine_utils.NEAR_TIE_NATS; how many
    part is printed."""
    if native.available() is not None:
        pytest.skip(f"the native kernels are not available here: {native.available()}")
    loaded = load_model(None, quantization=QuantConfig("auto", kernel="int8"))
    assert {k.name.split("/")[1] for m in loaded.model.modules() if isinstance(m, QuantLinear) for _, k in m.plan} == {
        "int8"
    }
    prompts = [chat_ids(loaded.tokenizer, q) for q in QUESTIONS]
    alone, batched = greedy_alone_and_batched(
        loaded, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    )
    parted = [j for a, b in zip(alone, batched) if (j := first_part_at_a_near_tie(a, b)) is not None]
    with capsys.disabled():
        print(
            f"\n[quant] int8 activations: {len(parted)}/{len(prompts)} batched runs part from alone "
            f"(at tokens {parted}) over 32 tokens"
        )


@pytest.fixture(scope="module", params=["int8", "int4"])
def tiny_quantized(request, tiny_dir):
    """One (exact) kernel for every row count: a recomputed prefix then equals the decoded one."""
    return load_model(str(tiny_dir), quantization=QuantConfig(request.param, kernel="exact"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_llama

    directory = tmp_path_factory.mktemp("tiny-q")
    make_tiny_llama(directory, tie=False, kv_heads=2, init_std=0.2, layers=2)
    return directory


def test_quantized_engine_prefix_cache_hit_gives_identical_output(tiny_quantized):
    prompt = list(range(3, 3 + 40))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = make_engine(tiny_quantized, num_blocks=32, block_size=8)
    engine.add_request("cold", prompt_token_ids=prompt, params=params)
    cold = run(engine)["cold"]
    engine.add_request("warm", prompt_token_ids=prompt, params=params)
    warm = run(engine)["warm"]
    assert warm.metrics.num_cached_tokens >= 32
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_all_blocks_free(engine)


def test_quantized_engine_preemption_keeps_outputs(tiny_quantized):
    """One kernel for every row count, so a tight pool (preemptions, recompute) must give exactly the
    outputs of a roomy one."""
    prompts = [list(range(5 + i, 5 + i + 20)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for blocks in (64, 7):
        engine = make_engine(tiny_quantized, num_blocks=blocks, block_size=8)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
        done = run(engine)
        outs.append([done[f"r{i}"].outputs[0].token_ids for i in range(4)])
        if blocks == 7:
            assert engine.scheduler.num_preemptions > 0, "the pool was not tight"
        assert_all_blocks_free(engine)
    assert outs[0] == outs[1]


def test_quantized_engine_runs_beams_and_parallel_samples(tiny_quantized):
    engine = make_engine(tiny_quantized, num_blocks=64, block_size=8)
    engine.add_request(
        "beams",
        prompt_token_ids=list(range(4, 20)),
        params=SamplingParams(use_beam_search=True, n=3, beam_width=3, max_tokens=8),
    )
    engine.add_request(
        "samples",
        prompt_token_ids=list(range(4, 20)),
        params=SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
    )
    outs = run(engine)
    beams = outs["beams"].outputs
    assert len(beams) == 3 and all(o.token_ids and o.finish_reason for o in beams)
    assert len({tuple(o.token_ids) for o in beams}) == 3, "beams are not distinct"
    assert len(outs["samples"].outputs) == 3 and all(len(o.token_ids) == 8 for o in outs["samples"].outputs)
    assert_all_blocks_free(engine)


def test_quantized_weights_shrink_the_model(tiny_quantized):
    report = tiny_quantized.quant
    assert report.mode.split()[0] in ("int8", "int4")
    assert report.ratio < (0.35 if report.mode.startswith("int8") else 0.30)


def test_int4_with_a_group_that_does_not_divide_a_layer_names_it(tiny_dir):
    with pytest.raises(
        ValueError, match=r"layers\.0\.self_attn\.qkv_proj\.weight of shape \(\d+, 64\) with group size 128"
    ):
        load_model(str(tiny_dir), quantization=QuantConfig("int4", group_size=128))


def test_auto_keeps_a_quantized_models_kv_in_fp16_on_a_cpu_and_an_fp32_models_in_fp32(tiny_quantized, tiny_model):
    """`--kv-cache-dtype auto`: quantized weights on a CPU get llama.cpp's K/V precision (fp16: twice the
    tokens in the pool's memory, half the bytes attention reads); an fp32 model, the HF-parity
    reference, keeps fp32; an explicit dtype wins either way."""

    def pool_dtype(loaded, **config):
        return make_engine(loaded, num_blocks=8, **config).kv_cache.k[0].dtype

    assert tiny_quantized.quant.quantized and pool_dtype(tiny_quantized) == torch.float16
    assert pool_dtype(tiny_quantized, kv_cache_dtype="float32") == torch.float32
    assert not tiny_model.quant.quantized and pool_dtype(tiny_model) == torch.float32
    assert pool_dtype(tiny_model, kv_cache_dtype="bfloat16") == torch.bfloat16
