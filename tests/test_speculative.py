"""Speculative decoding: drafts are verified exactly (greedy output identical to decoding without
them, sampling distribution-preserving), rejected drafts roll back without a leak, and every
request feature keeps working when its tokens arrive several at a time."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch

from engine_utils import EARLY_EXIT, NGRAM, EventLog, assert_all_blocks_free, compare, run, step_engine
from minivllm.core.block_manager import hash_block_tokens
from minivllm.engine.config import ConfigError, EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.events import types as ev
from minivllm.events.fold import fold
from minivllm.loader import load_model
from minivllm.sampling.params import SamplingParams
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.factory import check_same_vocabulary
from minivllm.spec_decode.ngram import propose_ngram
from minivllm.spec_decode.planner import EMA, Acceptance, StepCosts, plan_drafts
from minivllm.spec_decode.rejection import accept_greedy, rejection_sample

# drafts whenever possible (adaptive: false), so every test exercises verification (NGRAM, EARLY_EXIT: engine_utils)
DRAFT = {
    "method": "draft_model",
    "model": "random:tiny",
    "num_speculative_tokens": 3,
    "disable_by_batch_size": None,
    "adaptive": False,
}


def spec_engine(loaded, spec: dict | None, draft=None, **config) -> LLMEngine:
    config.setdefault("num_blocks", 64)
    config.setdefault("metrics_interval_s", 3600.0)
    speculative = SpeculativeConfig.parse(spec) if spec else None
    return LLMEngine(loaded, EngineConfig(**config), speculative=speculative, draft=draft)


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose continuations n-gram lookup can guess: repeated phrases."""
    rng = random.Random(7)
    prompts = []
    for length in (3, 5, 8):
        phrase = [rng.randrange(3, 5000) for _ in range(length)]
        prompts.append(phrase * 4 + phrase[:2])
    prompts.append([rng.randrange(3, 5000) for _ in range(20)])
    return prompts


def outputs_of(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=params)
    done = run(engine)
    assert_all_blocks_free(engine)
    return {rid: [(c.token_ids, c.finish_reason, c.text) for c in out.outputs] for rid, out in sorted(done.items())}


@pytest.fixture(scope="module")
def draft_other(tiny_model):
    """Another random model of the same shape and tokenizer: drafts it proposes are often wrong."""
    return load_model("random:tiny", dtype="float32", device="cpu", seed=1)


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, words",
    [
        ('{"method": "medusa"}', "unknown speculative method 'medusa'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min (4) exceeds"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "early_exit"}', "exit_layer must be an integer >= 1"),
        ('{"method": "ngram", "k": 3}', "unknown speculative config field(s) ['k']"),
        ('{"method": "ngram", "adaptive": "yes"}', "adaptive must be true or false"),
        ('{"num_speculative_tokens": 3}', "needs a method"),
        ("{method: ngram}", "not valid JSON"),
        ('["ngram"]', "must be a JSON object"),
    ],
)
def test_a_bad_config_says_what_is_wrong(value, words):
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.parse(value)
    assert words in str(info.value) and info.value.param == "speculative_config"


def test_exit_layer_outside_the_model_fails_at_start_up(tiny_model):
    with pytest.raises(ConfigError, match=r"exit_layer 2 is outside the model: it has 2 layers.*1\.\.1"):
        spec_engine(tiny_model, {"method": "early_exit", "exit_layer": 2})


def test_a_draft_with_another_vocabulary_is_refused_naming_both(tiny_model):
    other = load_model("random:tiny", dtype="float32", device="cpu")
    other.config = dataclasses.replace(other.config, vocab_size=32000)
    other.name = "other-draft"
    with pytest.raises(
        ConfigError,
        match=r"draft model other-draft has a vocabulary of 32000 tokens but the "
        rf"target {tiny_model.name} has 49152",
    ):
        check_same_vocabulary(tiny_model, other)


@pytest.mark.slow
def test_the_cli_refuses_a_bad_config_before_loading(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minivllm.cli",
            "generate",
            "--model",
            "random:tiny",
            "--speculative-config",
            '{"method": "lookahead"}',
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "unknown speculative method 'lookahead'" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the pieces ------------------------------------------------------------------------------


def test_ngram_lookup_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 5]  # "2 3" last seen before "7 8 5"
    assert propose_ngram(tokens, 1, 1, 3) == [7]
    assert propose_ngram([4, 5, 6], 3, 1, 3) == []  # nothing recurs
    assert propose_ngram([5, 6, 5], 3, 2, 3) == []  # only a 1-gram recurs, min is 2
    assert propose_ngram([5, 6, 5], 3, 1, 3) == [6, 5]  # the match may run into the suffix


def test_greedy_acceptance_stops_at_the_first_disagreement():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all accepted + bonus
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # correction replaces the first miss
    assert accept_greedy([3, 5, 6, 7], [4, 5, 6]) == [3]


@pytest.mark.slow
@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(one_hot):
    """Chi-square of the first emitted token against p, for a q far from p."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 6, 20000
    p = torch.tensor([[0.05, 0.4, 0.1, 0.25, 0.15, 0.05]] * 2)
    q = torch.tensor([[0.5, 0.05, 0.3, 0.05, 0.05, 0.05]])
    counts = torch.zeros(vocab)
    for _ in range(trials):
        draft = int(torch.multinomial(q[0], 1, generator=gen))
        first = rejection_sample(p, [draft], None if one_hot else q, gen)[0]
        counts[first] += 1
    expected = p[0] * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts.tolist())  # 5 dof: p = 0.001


# ---- greedy: identical to decoding without drafts ----------------------------------------------


def greedy_requests() -> list[tuple[list[int], SamplingParams]]:
    prompts = repetitive_prompts()
    return [
        (prompts[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        (prompts[1], SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, logprobs=2)),
        (
            prompts[2],
            SamplingParams(
                temperature=0,
                max_tokens=30,
                ignore_eos=True,
                repetition_penalty=1.3,
                frequency_penalty=0.4,
                presence_penalty=0.2,
            ),
        ),
        (prompts[3], SamplingParams(temperature=0, max_tokens=25, min_tokens=10, ignore_eos=True)),
        (prompts[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft_model_same", "draft_model_other"])
def test_greedy_output_is_identical_with_every_method(tiny_model, draft_other, method):
    spec, draft = {
        "ngram": (NGRAM, None),
        "early_exit": (EARLY_EXIT, None),
        "draft_model_same": (DRAFT, tiny_model),
        "draft_model_other": (DRAFT, draft_other),
    }[method]
    baseline = outputs_of(spec_engine(tiny_model, None), greedy_requests())
    engine = spec_engine(tiny_model, spec, draft)
    log = EventLog(engine)
    assert outputs_of(engine, greedy_requests()) == baseline
    verified = log.of(ev.SpecVerified)
    assert verified, "no draft was ever verified"
    accepted = sum(v.accepted for v in verified)
    assert accepted > 0, "no draft was accepted: the test cannot tell verification from plain decoding"
    if method == "draft_model_same":
        # the draft does not apply penalties (r2 has them): elsewhere the target agrees with itself
        assert all(v.accepted == len(v.proposed) for v in verified if v.request_id != "r2")
        assert any(v.accepted < len(v.proposed) for v in verified if v.request_id == "r2")
    else:
        assert accepted < sum(len(v.proposed) for v in verified), "no draft was rejected: rollback untested"
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens == accepted and stats.spec_num_drafts == len(verified)


def test_greedy_logprobs_are_the_targets(tiny_model):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    ids = repetitive_prompts()[0]
    plain, spec = spec_engine(tiny_model, None), spec_engine(tiny_model, NGRAM)
    plain.add_request("a", prompt_token_ids=ids, params=params)
    spec.add_request("a", prompt_token_ids=ids, params=params)
    a, b = run(plain)["a"].outputs[0], run(spec)["a"].outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        for token in x:
            assert abs(x[token] - y[token]) < 1e-5
    assert spec.stats().spec_num_accepted_tokens > 5


def test_stop_strings_and_tokens_inside_an_accepted_run_end_the_request_there(tiny_model):
    """The baseline's own output gives a stop token and a stop string that fall mid-run."""
    ids = repetitive_prompts()[0]
    base = spec_engine(tiny_model, None)
    base.add_request("x", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    free = run(base)["x"].outputs[0]
    stop_token, stop_text = free.token_ids[12], free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    requests = [
        (ids, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token])),
        (ids, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_text])),
        (ids, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
    ]
    baseline = outputs_of(spec_engine(tiny_model, None), requests)
    engine = spec_engine(tiny_model, NGRAM)
    got = outputs_of(engine, requests)
    assert got == baseline
    assert got["r0"][0][1] == "stop" and got["r1"][0][1] == "stop" and len(got["r2"][0][0]) == 9
    assert engine.stats().spec_num_accepted_tokens > 0


def test_preemption_in_the_middle_of_speculation_changes_nothing(tiny_model, draft_other):
    requests = [(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in repetitive_prompts()]
    baseline = outputs_of(spec_engine(tiny_model, None, num_blocks=64), requests)
    for spec, draft in ((NGRAM, None), (EARLY_EXIT, None), (DRAFT, draft_other)):
        engine = spec_engine(tiny_model, spec, draft, num_blocks=24, block_size=4, max_num_batched_tokens=32)
        log = EventLog(engine)
        assert outputs_of(engine, requests) == baseline, spec["method"]
        assert any(e.state == "PREEMPTED" for e in log.of(ev.RequestStateChanged)), "no preemption happened"
        assert log.of(ev.SpecVerified)


def test_aborts_mid_speculation_free_everything(tiny_model, draft_other):
    for spec, draft in ((NGRAM, None), (EARLY_EXIT, None), (DRAFT, draft_other)):
        engine = spec_engine(tiny_model, spec, draft)
        for i, ids in enumerate(repetitive_prompts()):
            engine.add_request(
                f"r{i}", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            )
        for _ in range(6):
            step_engine(engine)
        assert any(s.draft_token_ids for r in engine.requests.values() for s in r.seqs), "nothing drafted"
        for rid in list(engine.requests):
            engine.abort_request(rid)
        run(engine)
        assert_all_blocks_free(engine)
        if spec["method"] == "draft_model":
            engine.speculator.propose([])  # the draft pool lets go of sequences that left
            assert (
                engine.speculator.proposer.block_manager.num_free_blocks
                == engine.speculator.proposer.block_manager.num_blocks
            )


def test_rejected_tail_blocks_are_freed_and_only_verified_blocks_cached(tiny_model):
    """Drafts set by hand, every third one right (the baseline's token), the others wrong: verify
    chunks that reach into new blocks and are partly rejected."""
    ids, params = repetitive_prompts()[3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = spec_engine(tiny_model, None)
    base.add_request("a", prompt_token_ids=ids, params=params)
    expected = run(base)["a"].outputs[0].token_ids
    engine = spec_engine(tiny_model, None, block_size=4)
    log = EventLog(engine)
    engine.add_request("a", prompt_token_ids=ids, params=params)
    seen_trim, final, step = False, None, 0
    while engine.has_work():
        final = step_engine(engine)[-1]
        step += 1
        for request in engine.requests.values():
            seq = request.seqs[0]
            done = seq.num_output_tokens
            right = expected[done : done + 1] if step % 3 == 0 else []
            seq.draft_token_ids = right + [7, 8, 9][: 3 - len(right)]
        engine.block_manager.check_invariants()
        for request in engine.requests.values():
            seq = request.seqs[0]
            table = engine.block_manager.block_table(seq.seq_id)
            # after a step: blocks for the tokens (and the drafts proposed for the next step) only
            assert len(table) <= -(-(seq.num_tokens + len(seq.draft_token_ids)) // 4)
        seen_trim |= any(not e.whole_table and e.table is not None for e in log.of(ev.BlocksFreed))
    assert seen_trim, "no rejected tail was ever freed"
    assert final.outputs[0].token_ids == expected
    verified = log.of(ev.SpecVerified)
    assert {v.accepted for v in verified} == {0, 1}
    # every block ever cached holds verified tokens: its hash is in the final sequence's chain
    tokens = repetitive_prompts()[3] + final.outputs[0].token_ids
    chain, parent = set(), None
    for i in range(len(tokens) // 4):
        parent = hash_block_tokens(parent, tuple(tokens[i * 4 : (i + 1) * 4]))
        chain.add(ev.hash_hex(parent))
    cached = [h for e in log.of(ev.BlocksCached) for h in e.hashes]
    assert len(cached) >= 8 and set(cached) <= chain


# ---- sampling: distribution-preserving, reproducible -------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    """Two random models with a 12-token vocabulary and peaked logits: target and a draft that
    disagrees with it often (drafts get rejected and resampled from the residual)."""
    from tiny_models import make_tiny_llama

    root = tmp_path_factory.mktemp("small-vocab")
    make_tiny_llama(root / "target", seed=0, vocab=12, init_std=0.6)
    make_tiny_llama(root / "draft", seed=5, vocab=12, init_std=0.6)
    return (
        load_model(str(root / "target"), dtype="float32", device="cpu"),
        load_model(str(root / "draft"), dtype="float32", device="cpu"),
    )


def exact_next(loaded, ids: list[int]) -> torch.Tensor:
    engine = spec_engine(loaded, None)
    from minivllm.core.step_work import SeqWork

    logits = engine.runner.execute([], [SeqWork(list(ids), 0, list(range(-(-len(ids) // 16))))])
    return torch.softmax(logits[0], dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampling_with_drafts_follows_the_target_distribution(small_vocab_models, method):
    """2,000 samples of 3 tokens at temperature 1; the 2nd and 3rd tokens (which come through
    verification) against the target's exact conditional distributions, by chi-square."""
    target, draft = small_vocab_models
    prompt = [3, 4, 5, 3, 4, 5, 3, 4] + list(range(12))  # every token recurs: n-gram lookup always proposes
    spec = {"draft_model": {**DRAFT, "num_speculative_tokens": 2}, "ngram": {**NGRAM, "num_speculative_tokens": 2}}[
        method
    ]
    engine = spec_engine(
        target,
        spec,
        draft if method == "draft_model" else None,
        num_blocks=2048,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
    )
    log = EventLog(engine)
    samples = []
    for batch in range(8):
        for i in range(250):
            engine.add_request(
                f"b{batch}-{i}",
                prompt_token_ids=prompt,
                params=SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
            )
        samples += [tuple(o.outputs[0].token_ids) for o in run(engine, check_every_step=False).values()]
    verified = log.of(ev.SpecVerified)
    assert sum(len(v.proposed) - v.accepted for v in verified) > 500, "too few rejections to test the residual"
    assert sum(v.accepted for v in verified) > 10  # draft_model: ~80, ngram (one-hot q): ~15
    first = Counter(s[0] for s in samples).most_common(1)[0][0]
    check_chi_square([s[1] for s in samples if s[0] == first], exact_next(target, prompt + [first]))
    pair = Counter(s[:2] for s in samples).most_common(1)[0][0]
    check_chi_square([s[2] for s in samples if s[:2] == pair], exact_next(target, prompt + list(pair)))


def check_chi_square(observed: list[int], p: torch.Tensor) -> None:
    """Cells with an expected count under 5 are pooled; fails below a p-value of 0.001."""
    n = len(observed)
    assert n >= 200, f"only {n} samples"
    counts = Counter(observed)
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for token in range(p.shape[0]):
        expected = float(p[token]) * n
        if expected >= 5:
            cells.append((counts[token], expected))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts[token], pooled_exp + expected
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    p_value = float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
    assert p_value > 1e-3, (stat, p_value, cells)


def test_seeded_sampled_requests_are_reproducible_with_drafts(tiny_model, draft_other):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = spec_engine(tiny_model, DRAFT, draft_other)
        engine.add_request("s", prompt_token_ids=repetitive_prompts()[1], params=params)
        runs.append(run(engine)["s"].outputs[0].token_ids)
        assert engine.stats().spec_num_drafts > 0
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_n_and_beam_requests_run_without_drafts(tiny_model):
    requests = [
        (repetitive_prompts()[0], SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=20, ignore_eos=True)),
        (repetitive_prompts()[1], SamplingParams(use_beam_search=True, beam_width=2, max_tokens=10)),
        (repetitive_prompts()[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
    ]
    baseline = outputs_of(spec_engine(tiny_model, None), requests)
    engine = spec_engine(tiny_model, NGRAM)
    log = EventLog(engine)
    assert outputs_of(engine, requests) == baseline
    assert {v.request_id for v in log.of(ev.SpecVerified)} == {"r2"}


def test_disable_by_batch_size_turns_drafting_off_for_large_batches(tiny_model):
    requests = [
        (p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for p, n in zip(repetitive_prompts(), (8, 12, 16, 40))
    ]
    engine = spec_engine(tiny_model, {**NGRAM, "disable_by_batch_size": 4})
    log = EventLog(engine)
    outputs_of(engine, requests)
    running_when_verified = []
    for e in log.events:
        if isinstance(e, ev.StepScheduled):
            running = e.num_running
        if isinstance(e, ev.SpecVerified):
            running_when_verified.append(running)
    assert running_when_verified, "drafting never ran once the batch shrank"
    assert max(running_when_verified) < 4


# ---- seen: events fold, metrics ---------------------------------------------------------------


def test_fold_of_speculative_steps_equals_the_snapshots(tiny_model, draft_other):
    engine = spec_engine(tiny_model, EARLY_EXIT, num_blocks=24, block_size=4, max_num_batched_tokens=40)
    log = EventLog(engine)
    for i, ids in enumerate(repetitive_prompts()):
        engine.add_request(
            f"r{i}", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        )
    snapshots = [engine.snapshot()]
    while engine.has_work():
        step_engine(engine)
        snapshots.append(engine.snapshot())
    assert log.of(ev.SpecVerified) and any(c.num_draft for e in log.of(ev.StepScheduled) for c in e.decode)
    drafted = [e for e in log.of(ev.TokenGenerated) if e.drafted]
    assert len(drafted) == sum(v.accepted for v in log.of(ev.SpecVerified))
    for early, late in zip(snapshots, snapshots[1:]):
        compare(fold(early, [e for e in engine.bus.history if early.seq < e.seq <= late.seq]), late)
    info = engine.info()
    assert info.speculative == "early_exit: k=3, exit after layer 1"
    assert (
        SpeculativeConfig.parse({"method": "ngram"}).describe()
        == "ngram: k=3, n-gram 2-4, off at >= 4 requests, adaptive"
    )


def test_prometheus_has_vllms_spec_decode_counters(tiny_model):
    from minivllm.server.metrics import EngineGauges, ServerMetrics

    engine = spec_engine(tiny_model, NGRAM)
    outputs_of(engine, [(repetitive_prompts()[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])
    stats = engine.stats()
    text = ServerMetrics().render(EngineGauges("m", stats)).decode()
    assert f'minivllm:spec_decode_num_drafts_total{{model_name="m"}} {float(stats.spec_num_drafts)}' in text
    assert f'minivllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(stats.spec_num_draft_tokens)}' in text
    assert (
        f'minivllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(stats.spec_num_accepted_tokens)}'
    ) in text
    assert 'minivllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text
    assert stats.spec_accepted_per_position[0] >= stats.spec_accepted_per_position[-1]
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens > 0


def test_a_failing_proposer_costs_drafts_not_requests(tiny_model, caplog):
    requests = [(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for p in repetitive_prompts()]
    baseline = outputs_of(spec_engine(tiny_model, None), requests)
    engine = spec_engine(tiny_model, NGRAM)
    calls = []

    def broken(seqs, ks):
        calls.append(len(seqs))
        if len(calls) % 2:
            raise RuntimeError("proposer blew up")
        return original(seqs, ks)

    original, engine.speculator.proposer.propose = engine.speculator.proposer.propose, broken
    assert outputs_of(engine, requests) == baseline
    assert len(calls) > 4 and "proposer blew up" in caplog.text


def test_the_offline_api_takes_vllms_speculative_config():
    from minivllm.llm import LLM

    llm = LLM(
        "random:tiny",
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
        num_blocks=64,
        metrics_interval_s=3600.0,
    )
    ids = repetitive_prompts()[0]
    out = llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 24
    assert llm.engine.info().speculative.startswith("ngram: k=3") and llm.engine.stats().spec_num_drafts > 0


# ---- the adaptive planner ---------------------------------------------------------------------


def costs_of(by_rows: dict[int, float], round_s: float = 0.0) -> StepCosts:
    costs = StepCosts()
    for rows, seconds in by_rows.items():
        costs.observe(rows, seconds)
    costs.observe_rounds([round_s])
    return costs


def test_the_planner_drafts_where_it_pays_and_not_where_it_does_not():
    flat = costs_of({1: 0.1, 8: 0.1})  # extra rows free (a GPU): every draft pays
    assert plan_drafts([0.5, 0.2], [4, 4], 2, flat, per_round=False) == [4, 4]
    steep = costs_of({1: 0.1, 5: 0.27})  # a CPU: 5 rows cost 2.7x one
    assert plan_drafts([0.2], [4], 1, steep, per_round=False) == [0]  # 20% acceptance: a loss
    assert plan_drafts([0.95], [4], 1, steep, per_round=False) == [4]  # quoting: worth all four
    mixed = plan_drafts([0.95, 0.1], [4, 4], 2, costs_of({2: 0.1, 10: 0.2}), per_round=False)
    assert mixed[0] >= 3 and mixed[1] == 0
    # a draft model's rounds cost too: with dear rounds, fewer drafts
    cheap = plan_drafts([0.9], [4], 1, costs_of({1: 0.1, 5: 0.15}, round_s=0.005), per_round=True)
    dear = plan_drafts([0.9], [4], 1, costs_of({1: 0.1, 5: 0.15}, round_s=0.08), per_round=True)
    assert cheap == [4] and dear[0] < 4


def test_a_draft_models_later_rounds_are_priced_apart_from_its_first():
    """The first round also catches the draft's cache up (a chunk, run eagerly); later rounds are
    one token a sequence. Three rounds cost the first plus two later ones, not three firsts."""
    costs = StepCosts()
    costs.observe_rounds([0.030, 0.010, 0.010])
    assert costs.drafting_s(0) == 0.0
    assert costs.drafting_s(1) == pytest.approx(0.030)
    assert costs.drafting_s(3) == pytest.approx(0.050)
    only_first = StepCosts()
    only_first.observe_rounds([0.030])
    assert only_first.drafting_s(2) == pytest.approx(0.060)  # no later round seen yet: priced as a first
    # what it changes: at 90% acceptance, a 60 ms first round and 10 ms later ones, verify rows
    # costing little, drafting 4 deep pays, where pricing every round like the first stops earlier
    by_rows = {1: 0.1, 5: 0.12}
    assert plan_drafts([0.9], [4], 1, costs_of(by_rows, 0.060), per_round=True)[0] < 4
    priced_apart = costs_of(by_rows)
    priced_apart.observe_rounds([0.060, 0.010, 0.010, 0.010])
    assert plan_drafts([0.9], [4], 1, priced_apart, per_round=True) == [4]


def test_step_costs_interpolate_and_are_optimistic_above_what_was_measured():
    costs = costs_of({1: 0.1, 9: 0.5})
    assert costs.step_s(5) == pytest.approx(0.3)
    assert costs.step_s(16) == pytest.approx(0.5)  # unmeasured: tried at the largest known price
    costs.observe(9, 0.8)
    assert costs.step_s(9) == pytest.approx(0.5 + EMA * 0.3)


def test_a_smaller_step_never_costs_more_than_a_larger_one_measured():
    """One slow 2-row step (an outlier) must not price drafting out: 2 rows are never dearer than 4."""
    costs = costs_of({1: 0.060, 2: 0.117, 4: 0.104})
    assert costs.step_s(2) == pytest.approx(0.104)
    assert costs.step_s(3) == pytest.approx(0.104)
    assert costs.step_s(1) == pytest.approx(0.060)
    assert plan_drafts([0.9], [3], 1, costs, per_round=False) == [3]


def test_acceptance_is_learned_per_sequence_and_relaxes_back():
    acc = Acceptance()
    for _ in range(10):
        acc.observe(1, 4, 0)
        acc.observe(2, 4, 4)
    assert acc.rate(1) < 0.1 and acc.rate(2) > 0.95
    for _ in range(40):
        acc.relax(1)
    assert acc.rate(1) > 0.5  # tried again later
    acc.forget_except({2})
    assert acc.rate(1) == pytest.approx(0.6)


def test_a_draft_models_first_run_over_the_prompt_is_not_priced_as_a_round(tiny_model):
    """The draft model's first proposal runs the whole prompt: paid once per request. Priced as a
    round, it made every later draft look too dear, and the planner stopped drafting for good."""
    engine = spec_engine(tiny_model, {**DRAFT, "adaptive": True}, tiny_model)
    spec = engine.speculator
    priced, proposals = [], []
    observe_rounds, propose = spec.costs.observe_rounds, spec.proposer.propose
    spec.costs.observe_rounds = lambda seconds: (priced.append(spec.proposer.longest_catch_up), observe_rounds(seconds))

    def recording(seqs, ks):
        propose(seqs, ks)
        proposals.append(spec.proposer.longest_catch_up)

    spec.proposer.propose = recording
    ids = repetitive_prompts()[0]
    assert len(ids) > DRAFT["num_speculative_tokens"] + 1
    engine.add_request("a", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    run(engine)
    assert proposals[0] == len(ids) + 1  # the first proposal ran the prompt and the first token through the draft
    assert priced and max(priced) <= DRAFT["num_speculative_tokens"] + 1  # it was not priced; later rounds were


def test_adaptive_engine_stops_drafting_what_is_always_rejected(tiny_model):
    """Every draft is made wrong and verify rows are made to look expensive: the engine soon
    stops drafting; output unchanged."""
    ids, params = repetitive_prompts()[3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    base = spec_engine(tiny_model, None)
    base.add_request("a", prompt_token_ids=ids, params=params)
    expected = run(base)["a"].outputs[0].token_ids
    engine = spec_engine(tiny_model, {**NGRAM, "adaptive": True})
    engine.speculator.costs = costs_of({1: 0.01, 5: 0.03})

    def wrong(seqs, ks):
        for seq, k in zip(seqs, ks):
            seq.draft_token_ids = [7] * k

    engine.speculator.proposer.propose = wrong
    engine.speculator.costs.observe = lambda rows, seconds: None  # keep the made-up prices
    log = EventLog(engine)
    engine.add_request("a", prompt_token_ids=ids, params=params)
    assert run(engine)["a"].outputs[0].token_ids == expected
    verified = log.of(ev.SpecVerified)
    assert 1 <= len(verified) <= 20, len(verified)  # tried, learned, retried now and then


def test_the_environment_sets_the_speculative_config_for_serve():
    from minivllm.cli import apply_env_defaults, build_parser

    parser = build_parser()
    apply_env_defaults(parser, {"MINIVLLM_SPECULATIVE_CONFIG": '{"method": "ngram"}'})
    args = parser.parse_args(["serve"])
    assert SpeculativeConfig.parse(args.speculative_config).method == "ngram"
