"""The engine thread and its asyncio API: streaming, cancellation, bad requests, failing steps."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine_utils import make_engine, run, whole
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.outputs import OutputAccumulator
from minivllm.engine.request_validation import RequestRejectedError
from minivllm.events import types as ev
from minivllm.sampling.params import SamplingParams

PROMPT = "The library opens at nine and"
TIMEOUT_S = 30


def arun(coro):
    """asyncio.run with a deadline: a lost stream must fail the test, not hang it."""

    async def guarded():
        return await asyncio.wait_for(coro, TIMEOUT_S)

    return asyncio.run(guarded())


@pytest.fixture
def engine(tiny_model):
    """A started AsyncEngine on the tiny model; steps are slowed to ~20 ms so that 'within one step'
    is measurable."""
    llm_engine = make_engine(tiny_model, num_blocks=64)
    execute = llm_engine.runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(0.02)
        return execute(*args, **kwargs)

    llm_engine.runner.execute = slow_execute
    engine = AsyncEngine(llm_engine, idle_poll_s=0.05).start()
    yield engine
    engine.shutdown()
    assert not engine._thread.is_alive()


def sync_reference(tiny_model, prompt: str, params: SamplingParams):
    engine = make_engine(tiny_model)
    engine.add_request("ref", prompt, params)
    return run(engine)["ref"].outputs[0]


async def pool_state(engine: AsyncEngine):
    def read(e):
        e.block_manager.check_invariants()
        return e.block_manager.num_free_blocks, e.block_manager.num_blocks, list(e.requests)

    return await engine.call(read)


@pytest.mark.slow
def test_streamed_deltas_concatenate_to_the_final_text(engine, tiny_model):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def main():
        deltas, token_deltas, last = [], [], None
        async for out in engine.generate(PROMPT, params, request_id="stream"):
            deltas.append(out.outputs[0].text)
            token_deltas += out.outputs[0].token_ids
            assert out.outputs[0].num_tokens == len(token_deltas), "num_tokens counts every token so far"
            last = out
        return deltas, token_deltas, last

    deltas, token_deltas, last = arun(main())
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert len(deltas) > 1 and all(len(d) < len("".join(deltas)) for d in deltas), "the output was not streamed"
    assert len(token_deltas) == 24 == last.num_generated_tokens
    ref = sync_reference(tiny_model, PROMPT, params)
    assert (token_deltas, "".join(deltas)) == (ref.token_ids, ref.text)


def test_concurrent_streams(engine, tiny_model):
    prompts = [f"Request number {i} says" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def one(i):
        text, whole = "", OutputAccumulator()
        async for out in engine.generate(prompts[i], params, request_id=f"c{i}"):
            text += out.outputs[0].text
            final = whole.add(out)
        return text, final.outputs[0].text

    async def main():
        return await asyncio.gather(*(one(i) for i in range(4)))

    for (streamed, final), prompt in zip(arun(main()), prompts):
        assert streamed == final == sync_reference(tiny_model, prompt, params).text


def watch_steps(engine: AsyncEngine, request_id: str):
    """Bus events that concern the request, as (seq, event); appended on the engine thread."""
    seen: list = []

    def on_event(e):
        if isinstance(e, ev.StepScheduled):
            if any(c.request_id == request_id for c in e.prefill + e.decode):
                seen.append(("step", e.seq))
        elif isinstance(e, ev.RequestStateChanged) and e.request_id == request_id and e.state == "FINISHED":
            seen.append((e.finish_reason, e.seq))

    engine.engine.bus.subscribe(on_event)
    return seen


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_cancelling_the_consumer_aborts_within_one_step(engine, how):
    seen = watch_steps(engine, "long")
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def consume(counter: list, ready: asyncio.Event):
        async for out in engine.generate("Once upon a time", params, request_id="long"):
            counter.append(out)
            if len(counter) == 3:
                ready.set()
                if how == "break":
                    break

    async def main():
        counter, ready = [], asyncio.Event()
        task = asyncio.create_task(consume(counter, ready))
        await ready.wait()
        stopped_at = engine.engine.bus.last_seq
        if how == "cancel":
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        for _ in range(200):  # wait for the engine thread to process the abort
            free, total, live = await pool_state(engine)
            if "long" not in live:
                break
            await asyncio.sleep(0.01)
        return stopped_at, free, total, live, len(counter)

    stopped_at, free, total, live, received = arun(main())
    assert "long" not in live and free == total, "the cancelled request still holds blocks"
    assert received == 3
    finished = [seq for kind, seq in seen if kind != "step"]
    assert [kind for kind, _ in seen if kind != "step"] == ["abort"]
    steps_after = [seq for kind, seq in seen if kind == "step" and seq > stopped_at]
    assert len(steps_after) <= 1, f"the request ran {len(steps_after)} more steps after its consumer stopped"
    assert all(seq < finished[0] for seq in steps_after)


def test_bad_request_raises_before_any_output_and_the_engine_keeps_serving(engine, tiny_model):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def main():
        outputs = []
        with pytest.raises(RequestRejectedError, match="maximum context length"):
            async for out in engine.generate("hello", SamplingParams(max_tokens=10**6), request_id="too-long"):
                outputs.append(out)
        assert outputs == []
        with pytest.raises(RequestRejectedError):
            async for out in engine.generate(None, params, request_id="bad-ids", prompt_token_ids=[10**7]):
                outputs.append(out)
        assert outputs == []
        # a duplicate id fails alone: the request already running under that id is not disturbed
        first = engine.generate("First request", params, request_id="dup")
        first_out = await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            async for out in engine.generate("Second request", params, request_id="dup"):
                outputs.append(out)
        assert outputs == []
        tokens = list(first_out.outputs[0].token_ids)
        async for out in first:
            tokens += out.outputs[0].token_ids
        assert out.finished and out.outputs[0].finish_reason == "length" and len(tokens) == 8
        async for _ in engine.generate("Still serving", params, request_id="after"):
            pass
        return out

    out = arun(main())
    assert out.finished and out.outputs[0].num_tokens == 8
    assert engine.is_alive


def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine, tiny_model):
    llm_engine = engine.engine
    execute = llm_engine.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected kernel failure")
        return execute(*args, **kwargs)

    llm_engine.runner.execute = flaky
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def victim(rid):
        got = []
        with pytest.raises(RuntimeError, match="injected kernel failure"):
            async for out in engine.generate(f"Victim {rid}", params, request_id=rid):
                got.append(out)
        return got

    async def main():
        results = await asyncio.gather(victim("v1"), victim("v2"))
        free, total, live = await pool_state(engine)
        assert (free, total, live) == (total, total, [])
        out = await whole(
            engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), request_id="after")
        )
        return results, out

    results, out = arun(main())
    assert all(0 < len(got) < 40 for got in results)  # they were running when the step failed
    assert out.finished and out.outputs[0].num_tokens == 6
    assert (
        out.outputs[0].token_ids
        == sync_reference(tiny_model, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)).token_ids
    )
    assert engine.is_alive


def test_failed_step_spares_requests_still_waiting(tiny_model):
    """Only the requests the failed step was running fail; one still queued (max_num_seqs reached)
    never touched the failed batch and must complete normally."""
    llm_engine = make_engine(tiny_model, num_blocks=64, max_num_seqs=2)
    execute = llm_engine.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        time.sleep(0.01)
        if calls["n"] == 3:
            raise RuntimeError("injected kernel failure")
        return execute(*args, **kwargs)

    llm_engine.runner.execute = flaky
    engine = AsyncEngine(llm_engine, idle_poll_s=0.05).start()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def consume(rid):
        try:
            return await whole(engine.generate(f"Request {rid}", params, request_id=rid))
        except RuntimeError as exc:
            return str(exc)

    async def main():
        # v1 and v2 take the two seats; "queued" is added once they run, so it waits
        first = [asyncio.create_task(consume(r)) for r in ("v1", "v2")]
        while await engine.call(lambda e: len(e.scheduler.running)) < 2:
            await asyncio.sleep(0.005)
        queued = asyncio.create_task(consume("queued"))
        return await asyncio.gather(*first), await queued

    try:
        (v1, v2), queued = arun(main())
    finally:
        engine.shutdown()
    assert "injected kernel failure" in v1 and "injected kernel failure" in v2
    assert not isinstance(queued, str), f"the waiting request failed too: {queued}"
    assert queued.finished and len(queued.outputs[0].token_ids) == 20


@pytest.mark.slow
def test_tokenizing_a_prompt_never_freezes_running_streams(engine):
    """A prompt whose tokenization does not end (until released) must not stop a running stream:
    tokenizing happens off the engine thread. On the engine thread, the victim below would wait for
    the release and the test would time out."""
    llm_engine = engine.engine
    real_encode, entered, release = llm_engine.encode, threading.Event(), threading.Event()

    def stuck_encode(prompt):
        if prompt == "a huge prompt":
            entered.set()
            release.wait(TIMEOUT_S)
        return real_encode(prompt)

    llm_engine.encode = stuck_encode
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def main():
        victim = engine.generate(PROMPT, params, request_id="victim")
        first = await victim.__anext__()
        huge = asyncio.ensure_future(whole(engine.generate("a huge prompt", params, request_id="huge")))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, TIMEOUT_S)
        fold = OutputAccumulator()
        last = fold.add(first)
        async for out in victim:
            last = fold.add(out)
        still_tokenizing = not huge.done()
        release.set()
        return last, still_tokenizing, await huge

    last, still_tokenizing, huge = arun(main())
    assert last.finished and len(last.outputs[0].token_ids) == 30 and still_tokenizing
    assert huge.finished and len(huge.outputs[0].token_ids) == 30


def test_an_error_while_idle_does_not_kill_the_engine_thread(engine):
    llm_engine = engine.engine
    real, failures = llm_engine.emit_metrics_if_due, []

    def failing(*args, **kwargs):
        failures.append(1)
        raise RuntimeError("injected idle failure")

    llm_engine.emit_metrics_if_due = failing
    deadline = time.monotonic() + TIMEOUT_S
    while len(failures) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    llm_engine.emit_metrics_if_due = real
    assert len(failures) >= 3 and engine.is_alive

    async def main():
        return await whole(engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4), request_id="after"))

    assert arun(main()).finished
