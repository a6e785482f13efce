"""One request's fault stays with that request: a fault injected into one request's sampling,
forking, beam step or post-processing fails that request (error in its output, blocks freed) while
the requests batched with it finish exactly as they would alone, seeded samples included.

References are computed, never copied: each neighbour is run alone on a fresh engine."""

from __future__ import annotations

import asyncio

import pytest

from engine_utils import assert_all_blocks_free, make_engine, run, whole
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.errors import RequestFailedError
from minivllm.sampling.params import SamplingParams

NEIGHBOURS = {
    "greedy": ("The paged KV cache", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    "seeded": (
        "Continuous batching",
        SamplingParams(temperature=0.9, top_k=50, seed=7, n=2, max_tokens=12, ignore_eos=True),
    ),
}
BAD_ID = "bad"
BAD_PARAMS = {
    # a penalty, so that the sampler is handed the request's outputs (the fault waits for 3 of them)
    "sampling": SamplingParams(temperature=0.8, seed=3, presence_penalty=0.1, max_tokens=12, ignore_eos=True),
    "forking": SamplingParams(temperature=0.8, n=3, max_tokens=12, ignore_eos=True),
    "post-processing": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "beam": SamplingParams(use_beam_search=True, n=2, max_tokens=12, ignore_eos=True),
}


def inject(engine: LLMEngine, phase: str, after_tokens: int = 3) -> None:
    """Makes the request BAD_ID raise in `phase` once it has generated `after_tokens` tokens (the
    fork and the first beam step happen at once)."""

    def is_bad(request) -> bool:
        return request.request_id == BAD_ID

    def ripe(seq) -> bool:
        return is_bad(seq.request) and len(seq.output_token_ids) >= after_tokens

    if phase == "sampling":
        sampler = engine.step_sampler.sampler

        def faulty_sampler(logits, rows):
            result = sampler(logits, rows)  # fails after the draws: the seeded neighbours must be rewound
            if any(r.params is BAD_PARAMS["sampling"] and len(r.output_token_ids) >= after_tokens for r in rows):
                raise OverflowError("injected sampling fault")
            return result

        engine.step_sampler.sampler = faulty_sampler
    elif phase == "forking":
        tracker = engine.tracker
        fork = tracker.add_fork
        tracker.add_fork = lambda request, *a: _raise("injected fork fault") if is_bad(request) else fork(request, *a)
    elif phase == "post-processing":
        processor = engine.output_processor
        append = processor.append
        processor.append = lambda seq, *a: _raise("injected detokenizer fault") if ripe(seq) else append(seq, *a)
    elif phase == "beam":
        step_sampler = engine.step_sampler
        beam_step = step_sampler.beam_step
        step_sampler.beam_step = lambda request, logits: (
            _raise("injected beam fault") if is_bad(request) else beam_step(request, logits)
        )


def _raise(message: str):
    raise RuntimeError(message)


def alone(tiny_model, prompt: str, params: SamplingParams) -> list[list[int]]:
    engine = make_engine(tiny_model)
    engine.add_request("ref", prompt, params)
    return [o.token_ids for o in run(engine)["ref"].outputs]


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(BAD_PARAMS))
def test_a_fault_in_one_request_fails_only_that_request(tiny_model, phase):
    engine = make_engine(tiny_model, num_blocks=64)
    inject(engine, phase)
    engine.add_request(BAD_ID, "A request that breaks", BAD_PARAMS[phase])
    for rid, (prompt, params) in NEIGHBOURS.items():
        engine.add_request(rid, prompt, params)
    outs = run(engine)

    bad = outs[BAD_ID]
    assert bad.finished and bad.error and "injected" in bad.error and phase.split("-")[0] in bad.error, bad.error
    for rid, (prompt, params) in NEIGHBOURS.items():
        assert outs[rid].error is None
        assert [o.finish_reason for o in outs[rid].outputs] == ["length"] * params.n
        assert [o.token_ids for o in outs[rid].outputs] == alone(tiny_model, prompt, params), rid
    assert_all_blocks_free(engine)
    # the engine goes on serving
    prompt, params = NEIGHBOURS["greedy"]
    engine.add_request("after", prompt, params)
    assert [o.token_ids for o in run(engine)["after"].outputs] == alone(tiny_model, prompt, params)


def test_a_failed_request_reaches_its_stream_as_an_error_while_a_neighbour_streams_on(tiny_model):
    engine = make_engine(tiny_model, num_blocks=64)
    inject(engine, "post-processing")
    async_engine = AsyncEngine(engine).start()
    prompt, params = NEIGHBOURS["greedy"]

    async def consume(rid, text, p):
        return await whole(async_engine.generate(text, p, request_id=rid))

    async def main():
        victim = asyncio.ensure_future(consume("victim", prompt, params))
        with pytest.raises(RequestFailedError, match="post-processing.*injected detokenizer fault"):
            await consume(BAD_ID, "A request that breaks", BAD_PARAMS["post-processing"])
        return await victim

    try:
        last = asyncio.run(main())
        assert last.outputs[0].finish_reason == "length"
        assert [last.outputs[0].token_ids] == alone(tiny_model, prompt, params)
        assert async_engine.is_alive
    finally:
        async_engine.shutdown()
    assert_all_blocks_free(engine)
