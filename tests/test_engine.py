"""The continuous-batching engine: batching, preemption, block accounting, prefix caching, rejection,
abort, n > 1, seeds, stop conditions, logprobs, priorities and chunked prefill.

Output-equality tests use the embedded SmolLM2 model (real text, clear argmax margins); tests about
block accounting and scheduling structure use the tiny random model (fast).
References are always computed, never copied: "alone" means one request on an engine with prefix
caching off; logprobs are checked against HF's logits.
"""

from __future__ import annotations

import random
import re
import resource

import pytest
import torch

from engine_utils import EventLog, assert_all_blocks_free, chat_ids, compare, make_engine, run, step_engine
from minivllm.core.request import RequestStatus
from minivllm.engine.outputs import OutputAccumulator
from minivllm.engine.request_validation import RequestRejectedError
from minivllm.events import types as ev
from minivllm.events.fold import fold
from minivllm.sampling.params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three primary colors.",
    "How do I boil an egg?",
    "Name a famous painter and one of their works.",
]
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32)

SYSTEM_PROMPT = (
    "You are Quill, the writing assistant of the Northwind Library. You help visitors find books, "
    "summarise chapters, explain difficult passages and suggest further reading. Always answer in plain "
    "English, in at most three sentences, and never invent titles or authors: when you are not sure a "
    "book exists, say so. The library is open from nine in the morning to six in the evening on weekdays "
    "and from ten to four on Saturdays; it is closed on Sundays and public holidays. Members may borrow "
    "up to eight books for three weeks and renew them twice online. Late returns cost ten cents a day, "
    "capped at five dollars per book. The reading room on the second floor is silent; group study rooms "
    "on the third floor can be booked for two hours at a time. Printing costs five cents a page in black "
    "and white and twenty cents in colour. Lost cards are replaced for two dollars at the front desk. "
    "Children under twelve must be accompanied by an adult in the main hall."
)


def alone(loaded, prompts: list[list[int]], params: SamplingParams, **config) -> list:
    """Each request by itself on a fresh engine with prefix caching off: the reference."""
    outs = []
    for ids in prompts:
        engine = make_engine(loaded, enable_prefix_caching=False, **config)
        engine.add_request("alone", prompt_token_ids=ids, params=params)
        outs.append(run(engine)["alone"])
    return outs


@pytest.fixture(scope="module")
def chat_prompts(embedded_model):
    return [chat_ids(embedded_model.tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(embedded_model, chat_prompts):
    return alone(embedded_model, chat_prompts, GREEDY_32, num_blocks=16)


# ---- batching and preemption -----------------------------------------------------------------------


def test_batched_greedy_equals_alone(embedded_model, chat_prompts, reference):
    engine = make_engine(embedded_model, num_blocks=128)
    log = EventLog(engine)
    for i, ids in enumerate(chat_prompts):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=GREEDY_32)
    outs = run(engine)
    batch_sizes = [len(e.decode) + len(e.prefill) for e in log.of(ev.StepScheduled)]
    assert max(batch_sizes) == len(chat_prompts), "the requests were not batched together"
    for i, ref in enumerate(reference):
        got = outs[f"r{i}"].outputs[0]
        assert got.token_ids == ref.outputs[0].token_ids, QUESTIONS[i]
        assert got.text == ref.outputs[0].text
        assert got.finish_reason == ref.outputs[0].finish_reason
    assert_all_blocks_free(engine)


def test_tight_pool_completes_everything_with_preemptions(embedded_model, chat_prompts, reference):
    """6 blocks of 16 tokens hold about one request at a time: admission takes blocks as needed, so
    requests start together and must preempt each other; every output still equals the request alone."""
    engine = make_engine(embedded_model, num_blocks=6, block_size=16)
    log = EventLog(engine)
    for i, ids in enumerate(chat_prompts[:4]):
        engine.add_request(f"r{i}", prompt_token_ids=ids, params=GREEDY_32)
    outs = run(engine)
    preempted = [rid for e in log.of(ev.StepScheduled) for rid in e.preempted]
    assert preempted, "no preemption happened: the pool is not tight"
    assert engine.scheduler.num_preemptions == len(preempted)
    assert sum(o.metrics.num_preemptions for o in outs.values()) == len(preempted)
    states = [e for e in log.of(ev.RequestStateChanged) if e.state == "PREEMPTED"]
    assert len(states) == len(preempted) and all(e.reason for e in states)
    for i, ref in enumerate(reference[:4]):
        got = outs[f"r{i}"].outputs[0]
        assert (got.token_ids, got.text) == (ref.outputs[0].token_ids, ref.outputs[0].text), QUESTIONS[i]
    assert_all_blocks_free(engine)


def test_decode_step_temporaries_at_32_sequences_do_not_page_fault(embedded_model):
    """Each step at 32 sequences allocates multi-MB temporaries ([32, vocab] logits, K/V gathers,
    log-sum-exp). With glibc's default policy they were faulted in anew every step (~3,000 minor
    faults a step, a fifth of the step on the dev box); the engine's malloc settings keep freed
    memory for reuse. Run alone with MINIVLLM_NO_MALLOC_TUNING=1 to see this fail.
    The KV pool is another matter: its pages fault in once each, on their first write (it is resident
    only as it fills: ~360 faults a step at 32 sequences, ~1.8 us each, until its pages have all been
    used once). It is written through here first, so only the steps' own temporaries are counted."""
    engine = make_engine(embedded_model, num_blocks=200, block_size=16)
    for pool in (*engine.kv_cache.k, *engine.kv_cache.v):
        pool.fill_(0.0)
    for i in range(32):
        engine.add_request(
            f"r{i}",
            prompt_token_ids=[1, 100 + i, 200, 300, 400 + i],
            params=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        )
    step_until(engine, lambda: all(r.status == RequestStatus.DECODE for r in engine.requests.values()))
    for _ in range(3):  # the heap grows to the step's peak once
        step_engine(engine)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10):
        step_engine(engine)
    faults_per_step = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / 10
    print(f"\n[memory] minor page faults per decode step at 32 sequences: {faults_per_step:.0f}")
    assert faults_per_step < 100
    run(engine)


# ---- block accounting ------------------------------------------------------------------------------


def step_until(engine, predicate, max_steps: int = 200) -> list:
    outs = []
    for _ in range(max_steps):
        if predicate():
            return outs
        outs += step_engine(engine)
        engine.block_manager.check_invariants()
    raise AssertionError("condition never reached")


@pytest.mark.slow
def test_abort_in_every_state_frees_everything(tiny_model):
    engine = make_engine(tiny_model, num_blocks=10, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    bm = engine.block_manager
    ids = list(range(10, 40))
    decode = engine.add_request(
        "decode", prompt_token_ids=ids[:5], params=SamplingParams(max_tokens=20, ignore_eos=True)
    )
    prefill = engine.add_request(
        "prefill", prompt_token_ids=ids[:22], params=SamplingParams(max_tokens=4, ignore_eos=True)
    )
    waiting = engine.add_request("waiting", prompt_token_ids=ids[5:9], params=SamplingParams(max_tokens=4))
    seen: dict[str, list] = {}

    def abort(request, expected_state):
        assert request.status == expected_state
        seq_ids = [s.seq_id for s in request.all_seqs()]
        assert engine.abort_request(request.request_id) is True
        assert request.request_id not in engine.requests
        assert not any(bm.has_seq(s) for s in seq_ids)
        bm.check_invariants()
        seen[request.request_id] = []

    outs = step_until(engine, lambda: prefill.status == RequestStatus.PREFILL and prefill.seqs[0].num_computed > 0)
    assert prefill.seqs[0].num_computed < 22, "the prompt should be mid-way through chunked prefill"
    abort(prefill, RequestStatus.PREFILL)
    assert waiting.status == RequestStatus.WAITING  # max_num_seqs=2 kept it out until now
    abort(waiting, RequestStatus.WAITING)
    outs += step_until(engine, lambda: decode.status == RequestStatus.DECODE and decode.seqs[0].num_output_tokens >= 3)
    abort(decode, RequestStatus.DECODE)
    outs += step_engine(engine)  # abort outputs come out at the next step
    outs = {o.request_id: o for o in outs if o.finished}
    assert set(outs) == {"prefill", "waiting", "decode"}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs.values())
    assert outs["decode"].outputs[0].num_tokens >= 3

    # PREEMPTED: two growing requests in a pool that holds one of them
    engine.add_request("a", prompt_token_ids=ids[:4], params=SamplingParams(max_tokens=24, ignore_eos=True))
    b = engine.add_request("b", prompt_token_ids=ids[4:8], params=SamplingParams(max_tokens=24, ignore_eos=True))
    step_until(engine, lambda: b.status == RequestStatus.PREEMPTED)
    abort(b, RequestStatus.PREEMPTED)
    done = run(engine)
    assert done["b"].outputs[0].finish_reason == "abort"
    assert done["a"].outputs[0].finish_reason == "length" and len(done["a"].outputs[0].token_ids) == 24
    assert engine.abort_request("a") is False  # finished
    assert engine.abort_request("nope") is False  # unknown
    assert_all_blocks_free(engine)
    reasons = {
        e.request_id: e.finish_reason
        for e in engine.bus.history
        if isinstance(e, ev.RequestStateChanged) and e.state == "FINISHED"
    }
    assert reasons == {"prefill": "abort", "waiting": "abort", "decode": "abort", "a": "length", "b": "abort"}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_of_finish_abort_preempt_leaks_nothing(tiny_model, seed):
    """Random requests (n > 1, beams, stop tokens, shared prefixes) in a tight pool, random aborts:
    invariants hold after every step, every request finishes, and all blocks end up free."""
    rng = random.Random(seed)
    engine = make_engine(tiny_model, num_blocks=16, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)
    log = EventLog(engine)
    prefix = [rng.randrange(3, 1000) for _ in range(9)]
    added, aborted_in = [], {}
    for i in range(14):
        prompt = (prefix if rng.random() < 0.5 else []) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 12))]
        kind = rng.choice(["greedy", "sample", "n", "beam"])
        params = {
            "greedy": SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True),
            "sample": SamplingParams(
                temperature=1.0, seed=i, max_tokens=rng.randint(1, 20), stop_token_ids=[rng.randrange(3, 49152)]
            ),
            "n": SamplingParams(n=rng.randint(2, 3), temperature=1.0, seed=i, max_tokens=rng.randint(2, 10)),
            "beam": SamplingParams(
                use_beam_search=True, beam_width=2, n=rng.randint(1, 2), max_tokens=rng.randint(2, 8)
            ),
        }[kind]
        added.append((f"r{i}", prompt, params))

    def on_step(step: int) -> None:
        if added and rng.random() < 0.8:
            rid, prompt, params = added.pop(0)
            engine.add_request(rid, prompt_token_ids=prompt, params=params)
        live = list(engine.requests.values())
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            aborted_in[victim.request_id] = victim.status.value
            engine.abort_request(victim.request_id)

    done = {}
    while added or engine.has_work():
        done.update(run(engine, max_steps=3000, on_step=on_step) if engine.has_work() else {})
        if added and not engine.has_work():
            on_step(-1)
    assert len(done) == 14
    for rid, out in done.items():
        reasons = {o.finish_reason for o in out.outputs}
        if rid in aborted_in:  # samples that had already finished keep their own reason
            assert "abort" in reasons and reasons <= {"abort", "stop", "length"}, (rid, reasons)
        else:
            assert reasons <= {"stop", "length"}, (rid, reasons)
    assert_all_blocks_free(engine)
    assert any(e.preempted for e in log.of(ev.StepScheduled)), "the pool was never tight"


@pytest.mark.slow
def test_preempted_parallel_samples_resume(tiny_model):
    """n = 3 samples are preempted by a more urgent request once they have diverged, then resume from
    the prefix cache: they must be readmitted (the samples' shared cached prompt blocks are reused
    once, not counted once per sample) and finish exactly as they would have without preemption."""
    prompt = list(range(40, 57))  # 17 tokens, block size 4: 4 full blocks + 1 partial
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    ref_engine = make_engine(tiny_model, num_blocks=32, block_size=4)
    ref_engine.add_request("samples", prompt_token_ids=prompt, params=params)
    ref = [o.token_ids for o in run(ref_engine)["samples"].outputs]

    engine = make_engine(tiny_model, num_blocks=16, block_size=4)
    log = EventLog(engine)
    engine.add_request("samples", prompt_token_ids=prompt, params=params, priority=1)
    step_until(engine, lambda: len(engine.requests["samples"].seqs) == 3)
    engine.add_request(
        "urgent", prompt_token_ids=[7, 8, 9, 10], params=SamplingParams(max_tokens=40, ignore_eos=True), priority=0
    )
    done = run(engine, max_steps=300)
    assert [rid for e in log.of(ev.StepScheduled) for rid in e.preempted] == ["samples"]
    assert [o.token_ids for o in done["samples"].outputs] == ref
    assert len(done["urgent"].outputs[0].token_ids) == 40
    assert_all_blocks_free(engine)


MULTI_SEQUENCE_PARAMS = {
    "samples": SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
    "beams": SamplingParams(use_beam_search=True, beam_width=3, max_tokens=12, ignore_eos=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("prompt_len", [16, 17], ids=["block-aligned-prompt", "partial-block-prompt"])
@pytest.mark.parametrize("kind", ["samples", "beams"])
def test_preempted_multi_sequence_request_recomputes_shared_prefix_once(tiny_model, kind, prompt_len, prefix_caching):
    """Three samples (or beams) are preempted once they have diverged. On resume the common prefix is
    recomputed once by the first sequence and the others fork from it: without the prefix cache a
    copy per sequence (3 x 7 blocks) would exceed the 16-block pool admission validated the request
    against, and it would never resume. With the cache, the cached prefix is reattached and the fork
    happens either at once (aligned prompt) or after recomputing the partial block."""
    prompt = list(range(40, 40 + prompt_len))  # block size 4
    params = MULTI_SEQUENCE_PARAMS[kind]
    ref_engine = make_engine(tiny_model, num_blocks=32, block_size=4, enable_prefix_caching=prefix_caching)
    ref_engine.add_request("multi", prompt_token_ids=prompt, params=params)
    ref = [o.token_ids for o in run(ref_engine)["multi"].outputs]

    engine = make_engine(tiny_model, num_blocks=16, block_size=4, enable_prefix_caching=prefix_caching)
    log = EventLog(engine)
    engine.add_request("multi", prompt_token_ids=prompt, params=params, priority=1)
    step_until(
        engine,
        lambda: len(engine.requests["multi"].seqs) == 3 and engine.requests["multi"].seqs[0].num_output_tokens >= 2,
    )
    # 24 + 40 tokens: the urgent request ends up needing the whole pool
    engine.add_request(
        "urgent", prompt_token_ids=list(range(7, 31)), params=SamplingParams(max_tokens=40, ignore_eos=True), priority=0
    )
    shared_after_resume = []

    def watch(event):  # right after each schedule, before the forward
        request = engine.requests.get("multi")
        if (
            not isinstance(event, ev.StepScheduled)
            or request is None
            or not request.num_preemptions
            or request.refork_at is not None
        ):
            return
        tables = [engine.block_manager.block_table(s.seq_id) for s in request.seqs]
        if all(tables):
            shared_after_resume.append(len({t[0] for t in tables}) == 1)

    engine.bus.subscribe(watch)
    before = engine.snapshot()
    outs = step_until(engine, lambda: shared_after_resume, max_steps=400)
    # the dashboard's view (snapshot + events) of the re-forked tables matches the engine's
    compare(fold(before, [e for e in engine.bus.history if e.seq > before.seq]), engine.snapshot())
    done = {o.request_id: o for o in outs if o.finished}
    done.update(run(engine, max_steps=400))
    assert [rid for e in log.of(ev.StepScheduled) for rid in e.preempted] == ["multi"]
    assert [o.token_ids for o in done["multi"].outputs] == ref
    assert len(done["urgent"].outputs[0].token_ids) == 40
    assert shared_after_resume and all(shared_after_resume), (
        "the resumed sequences do not share the prompt's first block"
    )
    assert_all_blocks_free(engine)


# ---- prefix caching ----------------------------------------------------------------------------


def test_prefix_cache_hit_gives_identical_output(embedded_model):
    tok = embedded_model.tokenizer
    q1 = chat_ids(tok, "When is the library open on Saturdays?", system=SYSTEM_PROMPT)
    q2 = chat_ids(tok, "How much does colour printing cost?", system=SYSTEM_PROMPT)
    shared = next(i for i, (x, y) in enumerate(zip(q1, q2)) if x != y)
    assert shared >= 200, f"the shared system prompt is only {shared} tokens"
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ref1, ref2 = alone(embedded_model, [q1, q2], params, num_blocks=32)

    engine = make_engine(embedded_model, num_blocks=64, block_size=16)
    log = EventLog(engine)
    engine.add_request("first", prompt_token_ids=q1, params=params)
    first = run(engine)["first"]
    assert first.metrics.num_cached_tokens == 0
    mark = len(log.events)
    engine.add_request("again", prompt_token_ids=q1, params=params)
    again = run(engine)["again"]
    engine.add_request("other", prompt_token_ids=q2, params=params)
    other = run(engine)["other"]

    # the identical prompt reuses every full block but the one holding its last token
    assert again.metrics.num_cached_tokens == (len(q1) - 1) // 16 * 16
    # a different question after the same system prompt reuses the system prompt's full blocks
    assert other.metrics.num_cached_tokens == shared // 16 * 16
    hits = [e for e in log.events[mark:] if isinstance(e, ev.BlocksShared) and e.prefix_hit]
    assert [sum(len(e.block_ids) for e in hits if e.request_id == r) for r in ("again", "other")] == [
        (len(q1) - 1) // 16,
        shared // 16,
    ]
    assert engine.stats().prefix_cache_hits == again.metrics.num_cached_tokens + other.metrics.num_cached_tokens
    for got, ref in ((first, ref1), (again, ref1), (other, ref2)):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert got.outputs[0].text == ref.outputs[0].text
    assert_all_blocks_free(engine)
    assert engine.block_manager.num_cached_free_blocks > 0  # freed blocks stay reusable


# ---- rejection -----------------------------------------------------------------------------------


def test_requests_that_can_never_fit_are_rejected_at_once(tiny_model):
    engine = make_engine(tiny_model, num_blocks=4, block_size=16, max_model_len=128)
    log = EventLog(engine)
    engine.add_request("ok-before", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(RequestRejectedError) as too_long:
        engine.add_request("too-long", prompt_token_ids=list(range(100, 130)), params=SamplingParams(max_tokens=120))
    assert "128" in str(too_long.value) and "150" in str(too_long.value)  # the limit and what was asked
    with pytest.raises(RequestRejectedError) as prompt_too_long:
        engine.add_request(
            "prompt-too-long", prompt_token_ids=list(range(100, 300)), params=SamplingParams(max_tokens=1)
        )
    assert "200" in str(prompt_too_long.value) and "128" in str(prompt_too_long.value)
    with pytest.raises(RequestRejectedError) as too_big:  # fits max_model_len, not the 4-block pool
        engine.add_request("too-big", prompt_token_ids=list(range(100, 140)), params=SamplingParams(max_tokens=40))
    assert re.search(r"\b5\b", str(too_big.value)) and re.search(r"\b4\b", str(too_big.value))
    with pytest.raises(RequestRejectedError):  # 3 samples of 40 new tokens each cannot share 4 blocks
        engine.add_request("too-wide", prompt_token_ids=[1, 2], params=SamplingParams(n=3, max_tokens=40))
    engine.add_request("ok-after", prompt_token_ids=[8, 9], params=SamplingParams(max_tokens=8, ignore_eos=True))
    done = run(engine, max_steps=100)
    assert set(done) == {"ok-before", "ok-after"}
    assert all(len(o.outputs[0].token_ids) == 8 for o in done.values())
    assert {e.request_id for e in log.of(ev.RequestArrived)} == {"ok-before", "ok-after"}
    assert_all_blocks_free(engine)


def test_stop_lists_are_bounded_by_the_engine_configuration(tiny_model):
    engine = make_engine(tiny_model, max_stop_strings=3, max_stop_chars=10)
    with pytest.raises(RequestRejectedError, match=r"at most 3 strings, got 4") as many:
        engine.add_request("many", prompt_token_ids=[5], params=SamplingParams(stop=["a", "b", "c", "d"]))
    assert many.value.param == "stop"
    with pytest.raises(RequestRejectedError, match=r"total at most 10 characters, got 11"):
        engine.add_request("long", prompt_token_ids=[5], params=SamplingParams(stop=["abcdef", "ghijk"]))
    engine.add_request("ok", prompt_token_ids=[5], params=SamplingParams(stop=["abc", "def", "ghij"], max_tokens=2))
    default = make_engine(tiny_model)
    default.add_request("64", prompt_token_ids=[5], params=SamplingParams(stop=[f"s{i}" for i in range(64)]))
    with pytest.raises(RequestRejectedError, match="at most 64 strings"):
        default.add_request("65", prompt_token_ids=[5], params=SamplingParams(stop=[f"s{i}" for i in range(65)]))


def test_llm_generate_with_a_bad_prompt_leaves_nothing_behind(tiny_model, monkeypatch):
    import minivllm.engine.factory
    from minivllm import LLM

    monkeypatch.setattr(minivllm.engine.factory, "load_model", lambda *a, **k: tiny_model)
    llm = LLM(num_blocks=16, max_model_len=64)
    with pytest.raises(RequestRejectedError):
        llm.generate(prompt_token_ids=[[1, 2, 3], list(range(100))], sampling_params=SamplingParams(max_tokens=4))
    assert not llm.engine.has_work(), "the good prompt of the failed call is still queued"
    assert_all_blocks_free(llm.engine)
    outs = llm.generate(
        prompt_token_ids=[[4, 5, 6]], sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 4


def test_more_samples_than_the_token_budget_is_rejected_or_runs(tiny_model):
    """n parallel samples must all decode in the same step: with a token budget smaller than n the
    request could never make progress, so it must be rejected up front, never hang."""
    engine = make_engine(tiny_model, num_blocks=32, block_size=4, max_num_batched_tokens=2)
    try:
        engine.add_request("wide", prompt_token_ids=[5, 6, 7], params=SamplingParams(n=3, max_tokens=4, seed=0))
    except RequestRejectedError as exc:
        assert "max_num_batched_tokens" in str(exc)
        return
    done = run(engine, max_steps=200)
    assert [len(o.token_ids) for o in done["wide"].outputs] == [4, 4, 4]


# ---- n > 1 and seeds ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_parallel_samples_share_prompt_blocks_and_reproduce(tiny_model):
    prompt = list(range(300, 322))  # 22 tokens: one full block of 16 and a partial one
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)

    def once():
        engine = make_engine(tiny_model, num_blocks=32, block_size=16)
        log = EventLog(engine)
        shared_tables = []

        def watch(step):
            req = engine.requests.get("n3")
            if req is not None and len(req.seqs) == 3:
                shared_tables.append([engine.block_manager.block_table(s.seq_id) for s in req.seqs])

        engine.add_request("n3", prompt_token_ids=prompt, params=params)
        out = run(engine, on_step=watch)["n3"]
        assert_all_blocks_free(engine)
        return out, log, shared_tables

    out, log, tables = once()
    forks = [e for e in log.of(ev.BlocksShared) if not e.prefix_hit]
    assert len(forks) == 2 and all(e.request_id == "n3" for e in forks)
    copies = log.of(ev.BlocksCopied)
    assert copies, "the shared partial prompt block was never copied on write"
    prompt_blocks = forks[0].block_ids
    assert all(src in prompt_blocks for e in copies for src in e.src_block_ids)
    assert tables and all(t[0][0] == t[1][0] == t[2][0] for t in tables), "the full prompt block is not shared"
    assert [o.index for o in out.outputs] == [0, 1, 2]
    samples = [o.token_ids for o in out.outputs]
    assert all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) > 1, "three seeded samples came out identical"
    again, _, _ = once()
    assert [o.token_ids for o in again.outputs] == samples


@pytest.mark.slow
def test_seeded_request_same_alone_and_in_a_batch(tiny_model):
    prompt = list(range(500, 513))
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone_engine = make_engine(tiny_model)
    alone_engine.add_request("seeded", prompt_token_ids=prompt, params=params)
    ref = run(alone_engine)["seeded"].outputs[0].token_ids

    engine = make_engine(tiny_model)
    engine.add_request(
        "other-1", prompt_token_ids=list(range(700, 740)), params=SamplingParams(temperature=1.0, max_tokens=20)
    )
    engine.add_request(
        "other-2", prompt_token_ids=[9, 9, 9], params=SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )
    step_engine(engine)
    engine.add_request("seeded", prompt_token_ids=prompt, params=params)
    engine.add_request(
        "other-3",
        prompt_token_ids=list(range(800, 805)),
        params=SamplingParams(temperature=1.5, seed=99, max_tokens=30, ignore_eos=True),
    )
    done = run(engine)
    assert done["seeded"].outputs[0].token_ids == ref
    assert_all_blocks_free(engine)


# ---- stop conditions and logprobs --------------------------------------------------------------


@pytest.fixture(scope="module")
def france(embedded_model):
    """A greedy answer that ends with EOS, with its per-token text pieces."""
    ids = chat_ids(embedded_model.tokenizer, "What is the capital of France? Answer in one sentence.")
    engine = make_engine(embedded_model, num_blocks=16)
    log = EventLog(engine)
    engine.add_request("france", prompt_token_ids=ids, params=SamplingParams(temperature=0.0, max_tokens=40))
    out = run(engine)["france"].outputs[0]
    pieces = [e.text for e in log.of(ev.TokenGenerated)]
    assert out.finish_reason == "stop" and out.token_ids[-1] in embedded_model.config.eos_token_ids
    assert len(out.token_ids) >= 6
    return ids, out, pieces


def stream(engine, rid, ids, params):
    engine.add_request(rid, prompt_token_ids=ids, params=params)
    deltas, final, whole = [], None, OutputAccumulator()
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.outputs[0].text)
                final = whole.add(out)
    return final.outputs[0], deltas


def test_stop_string_split_across_tokens_never_leaks(embedded_model, france):
    ids, full, pieces = france
    text = full.text
    # a stop string made of the end of one token's text and the start of the next one's
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    start = text.index(stop)
    # the token whose text completes the first occurrence of the stop string ends the generation
    last = next(j for j in range(len(pieces)) if len("".join(pieces[: j + 1])) >= start + len(stop))
    engine = make_engine(embedded_model, num_blocks=16)
    log = EventLog(engine)
    out, deltas = stream(engine, "stop", ids, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop, "zzzz-never"]))
    assert out.text == text[:start]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert "".join(deltas) == out.text
    assert "".join(e.text for e in log.of(ev.TokenGenerated)) == out.text
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    # generation ended with the token that completed the stop string
    assert len(out.token_ids) == last + 1


def test_stop_token_ids_and_eos(embedded_model, france):
    ids, full, _ = france
    stop_token = full.token_ids[3]
    first = full.token_ids.index(stop_token)
    engine = make_engine(embedded_model, num_blocks=16)
    out, _ = stream(engine, "stop-id", ids, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token]))
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    assert full.stop_reason is None  # EOS ends with "stop" and no stop_reason
    eos_text, _ = stream(engine, "eos", ids, SamplingParams(temperature=0.0, max_tokens=40))
    assert eos_text.token_ids == full.token_ids and eos_text.text == full.text


def test_min_tokens_and_max_tokens(embedded_model, france):
    ids, full, _ = france
    n = len(full.token_ids)  # the last one is EOS
    engine = make_engine(embedded_model, num_blocks=16)
    longer, _ = stream(engine, "min", ids, SamplingParams(temperature=0.0, max_tokens=n + 4, min_tokens=n + 4))
    assert len(longer.token_ids) == n + 4 and longer.finish_reason == "length"
    assert longer.token_ids[: n - 1] == full.token_ids[: n - 1]
    eos = set(embedded_model.config.eos_token_ids)
    assert not eos & set(longer.token_ids)
    cut, _ = stream(engine, "max", ids, SamplingParams(temperature=0.0, max_tokens=3))
    assert cut.token_ids == full.token_ids[:3] and cut.finish_reason == "length"
    # min_tokens also holds back stop_token_ids
    stop_token = full.token_ids[1]
    held, _ = stream(
        engine,
        "min-stop",
        ids,
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[stop_token]),
    )
    assert held.token_ids[0] == full.token_ids[0] and held.token_ids[1] != stop_token
    assert len(held.token_ids) >= 4


def test_logprobs_match_hf(embedded_model, hf_embedded_model, france):
    ids, full, _ = france
    engine = make_engine(embedded_model, num_blocks=16)
    out, _ = stream(engine, "lp", ids, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))
    assert len(out.logprobs) == 5
    with torch.no_grad():
        logits = hf_embedded_model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1].float()
    ref = torch.log_softmax(logits, dim=-1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = torch.topk(ref[step], 3)
        assert token in entry and set(top.indices.tolist()) <= set(entry)
        assert len(entry) <= 4
        assert token == top.indices[0].item()  # greedy: the chosen token is the top-1
        for t, lp in entry.items():
            assert lp == pytest.approx(ref[step, t].item(), abs=1e-4)
        total += entry[token]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)


# ---- priority and chunked prefill ----------------------------------------------------------------


@pytest.mark.slow
def test_lower_priority_value_runs_first_when_the_pool_is_tight(tiny_model):
    # 5 blocks of 4 tokens hold one request (13 prompt + 6 new tokens) at a time; arrival order is
    # the reverse of the priority order
    engine = make_engine(tiny_model, num_blocks=5, block_size=4, max_num_seqs=4)
    log = EventLog(engine)
    for rid, prio in (("late", 5), ("mid", 1), ("urgent", 0)):
        engine.add_request(
            rid,
            prompt_token_ids=list(range(11, 24)),
            params=SamplingParams(max_tokens=6, ignore_eos=True),
            priority=prio,
        )
    done = run(engine)
    first_token = sorted(done, key=lambda r: done[r].metrics.first_token_time)
    assert first_token == ["urgent", "mid", "late"]
    finished = [e.request_id for e in log.of(ev.RequestStateChanged) if e.state == "FINISHED"]
    assert finished == ["urgent", "mid", "late"]


@pytest.mark.slow
def test_preemption_picks_the_lowest_priority_running_request(tiny_model):
    # both fit at first, not both to the end: the older but less urgent one must give way
    engine = make_engine(tiny_model, num_blocks=6, block_size=4)
    log = EventLog(engine)
    engine.add_request(
        "background", prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(max_tokens=16, ignore_eos=True), priority=3
    )
    engine.add_request(
        "interactive", prompt_token_ids=[5, 6, 7, 8], params=SamplingParams(max_tokens=16, ignore_eos=True), priority=0
    )
    done = run(engine)
    preempted = [rid for e in log.of(ev.StepScheduled) for rid in e.preempted]
    assert preempted and set(preempted) == {"background"}
    assert done["interactive"].metrics.num_preemptions == 0
    assert all(len(o.outputs[0].token_ids) == 16 for o in done.values())


def test_chunked_prefill_keeps_decoding(embedded_model):
    """A prompt longer than the token budget is split over several steps, and the decoding request
    gets a token in every one of them; both outputs equal the requests alone."""
    tok = embedded_model.tokenizer
    talker = chat_ids(tok, "Count from one to twenty in words.")
    long_prompt = chat_ids(tok, "Summarise the rules below in one sentence.", system=SYSTEM_PROMPT)
    budget = 32
    assert len(long_prompt) > 4 * budget
    talk_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    long_params = SamplingParams(temperature=0.0, max_tokens=6)
    (ref_talk,) = alone(embedded_model, [talker], talk_params, num_blocks=32)
    (ref_long,) = alone(embedded_model, [long_prompt], long_params, num_blocks=32)

    engine = make_engine(embedded_model, num_blocks=64, max_num_batched_tokens=budget)
    log = EventLog(engine)
    engine.add_request("talker", prompt_token_ids=talker, params=talk_params)
    while not engine.requests["talker"].seqs[0].num_output_tokens:
        step_engine(engine)
    mark = len(log.events)
    engine.add_request("long", prompt_token_ids=long_prompt, params=long_params)
    done = run(engine)
    steps = [e for e in log.events[mark:] if isinstance(e, ev.StepScheduled)]
    prefill_steps = [s for s in steps if any(c.request_id == "long" for c in s.prefill)]
    chunks = [c for s in prefill_steps for c in s.prefill if c.request_id == "long"]
    assert len(prefill_steps) >= 4
    assert sum(c.num_tokens for c in chunks) == len(long_prompt)
    assert [c.start for c in chunks] == [sum(x.num_tokens for x in chunks[:i]) for i in range(len(chunks))]
    for s in prefill_steps:
        assert [c.request_id for c in s.decode] == ["talker"], "the decoding request was stalled"
        assert s.budget_used <= s.budget == budget
    assert done["talker"].outputs[0].token_ids == ref_talk.outputs[0].token_ids
    assert done["long"].outputs[0].token_ids == ref_long.outputs[0].token_ids
    assert_all_blocks_free(engine)


@pytest.mark.slow
def test_a_rebuild_frees_the_old_pool_before_allocating_the_new_one(monkeypatch):
    """The runner (and on CUDA its graphs) and the speculator held the old pool while the new one was
    allocated: twice the pool's memory at the peak of every settings change."""
    import gc
    import weakref

    from minivllm.engine import llm_engine
    from minivllm.loader import load_model

    engine = make_engine(load_model("random:tiny", quantization="none", max_model_len=128), num_blocks=16)
    old, real, alive = weakref.ref(engine.kv_cache), llm_engine.KVCache, []

    def allocating(*args, **kwargs):
        gc.collect()
        alive.append(old() is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "KVCache", allocating)
    engine.reconfigure(num_blocks=24)
    assert alive == [False] and engine.kv_cache.num_blocks == 24


def test_cache_salt_isolates_the_prefix_cache_between_tenants():
    """vLLM's cache_salt: the same prompt hits the prefix cache under the same salt only (a salt
    seeds the first block's chained hash); unsalted requests share with each other, not with salted ones."""
    from test_server_support import tiny_engine

    engine = tiny_engine()
    prompt = "A prompt long enough to fill at least two blocks of sixteen tokens, shared by two tenants here."

    def cached(request_id: str, salt: str | None) -> int:
        request = engine.add_request(request_id, prompt, SamplingParams(max_tokens=1), cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        return request.num_cached_prompt_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("a2", "tenant-a") >= 16
    assert cached("b1", "tenant-b") == 0
    assert cached("plain1", None) == 0 and cached("plain2", None) >= 16
