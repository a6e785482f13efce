"""Pooling requests in the engine and `POST /v1/embeddings`.

References are always computed: transformers' final hidden states (`AutoModelForCausalLM(...).model`,
the output of the final RMSNorm) on the embedded model in fp32, or, for the tiny random model, one
plain forward pass of our own model over the whole prompt (`scoring.forward_prefills`), pooled
(last token or mean) and L2-normalised here.
"""

from __future__ import annotations

import asyncio
import base64
import random
import struct

import openai
import pytest
import torch
import torch.nn.functional as F
from litestar.testing import TestClient
from test_server_support import server_of, tiny_app, tiny_engine
from test_server_support import tiny_model as served_model

from engine_utils import EventLog, assert_all_blocks_free, compare, first_part_at_a_near_tie, make_engine
from minivllm.cli import build_parser
from minivllm.core.request import RequestStatus
from minivllm.engine.api import (
    AsyncEngine,
    OutputAccumulator,
    PoolingParams,
    PoolingRequestOutput,
    RequestRejectedError,
)
from minivllm.engine.config import EngineConfig
from minivllm.engine.factory import create_engine
from minivllm.engine.scoring import forward_prefills
from minivllm.events import types as ev
from minivllm.events.fold import fold
from minivllm.quant.policy import QuantConfig
from minivllm.sampling.params import SamplingParams
from minivllm.server.config import ServerConfig

HF_MIN_COSINE = 0.9999  # the engine against transformers (fp32); 4-bit measured 0.99996-0.999996 on 4 inputs
FP32_MIN_COSINE = 0.999999  # the engine in fp32 against transformers: measured 1.0000000 to 7 digits
SAME_MODEL_MIN_COSINE = 0.99999  # the engine against one plain forward pass of the same model


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def pool(final_hidden: torch.Tensor, pooling_type: str, normalize: bool = True) -> torch.Tensor:
    """[len, hidden] final-normed states -> one vector, as the reference."""
    vector = final_hidden[-1] if pooling_type == "last" else final_hidden.mean(dim=0)
    return F.normalize(vector.double(), dim=0) if normalize else vector.double()


def own_reference(loaded, ids: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    hidden: list[torch.Tensor] = []
    forward_prefills(loaded, [ids], hidden_states_out=hidden)
    return pool(hidden[-1].float(), pooling_type, normalize)


def cosine(vector: list[float], reference: torch.Tensor) -> float:
    return F.cosine_similarity(torch.tensor(vector, dtype=torch.float64), reference.double(), dim=0).item()


def run_engine(engine, on_step=None) -> dict[str, object]:
    """Steps until idle (block invariants checked every step); every request's final output.
    `on_step(number)` runs before each step."""
    done, whole = {}, OutputAccumulator()
    for number in range(5000):
        if not engine.has_work():
            return done
        if on_step is not None:
            on_step(number)
        for out in engine.step():
            final = out if isinstance(out, PoolingRequestOutput) else whole.add(out)
            if final.finished:
                done[out.request_id] = final
        engine.block_manager.check_invariants()
    raise AssertionError("the engine is still busy after 5000 steps")


def pool_all(engine, prompts: list[list[int]], params: PoolingParams) -> list[PoolingRequestOutput]:
    ids = [f"p{i}" for i in range(len(prompts))]
    engine.add_pooling_requests(ids, prompts, params)
    done = run_engine(engine)
    return [done[i] for i in ids]  # type: ignore[misc]


# ---- against transformers (the embedded model) -------------------------------------------

TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache keeps the keys and values of earlier tokens so that each new token attends to them "
    "without recomputing the whole prefix. " * 4,
    "Embeddings map text to vectors; similar texts land close together.",
]


@pytest.mark.parametrize(
    "model,min_cosine",
    [("embedded_model", FP32_MIN_COSINE), ("embedded_model_q4", HF_MIN_COSINE)],
    ids=["fp32", "4-bit"],
)
@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_embeddings_match_transformers(request, hf_embedded_model, embedded_tokenizer, model, min_cosine, pooling_type):
    """Several inputs of different lengths in one batch, prefilled in chunks of at most 48 tokens, by
    the engine in fp32 and at its 4-bit default (Q4_1 layers, int8 activations in our kernels)."""
    prompts = [embedded_tokenizer.encode(t) for t in TEXTS]
    assert sorted(map(len, prompts))[0] < 5 and max(map(len, prompts)) > 100, [len(p) for p in prompts]
    engine = make_engine(request.getfixturevalue(model), num_blocks=48, max_num_batched_tokens=48, max_model_len=512)
    outs = pool_all(engine, prompts, PoolingParams(pooling_type))
    for ids, out in zip(prompts, outs):
        with torch.inference_mode():
            hf_hidden = hf_embedded_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        assert len(out.embedding) == hf_embedded_model.config.hidden_size
        assert cosine(out.embedding, pool(hf_hidden, pooling_type)) >= min_cosine, len(ids)
        assert abs(torch.tensor(out.embedding).norm().item() - 1) < 1e-5
    assert_all_blocks_free(engine)


# ---- the engine (tiny random model) ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_pooling_ignores_chunking_batching_and_the_prefix_cache(tiny_model, pooling_type):
    """Chunks of 7 tokens, four prompts at once, and the same prompts again: last-token pooling
    takes the cache hit, mean pooling computes every token again; all equal one plain forward pass."""
    prompts = [prompt_ids(n, seed=n) for n in (1, 9, 33, 70)]
    engine = make_engine(tiny_model, max_num_batched_tokens=7)
    params = PoolingParams(pooling_type)
    first, again = pool_all(engine, prompts, params), pool_all(engine, prompts, params)
    for ids, a, b in zip(prompts, first, again):
        reference = own_reference(tiny_model, ids, pooling_type)
        assert cosine(a.embedding, reference) >= SAME_MODEL_MIN_COSINE
        assert cosine(b.embedding, reference) >= SAME_MODEL_MIN_COSINE
    cached = [out.metrics.num_cached_tokens for out in again]
    assert cached == ([0, 0, 32, 64] if pooling_type == "last" else [0, 0, 0, 0]), cached
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_normalize_false_returns_the_raw_pooled_state(tiny_model, pooling_type):
    ids = prompt_ids(20, seed=5)
    (out,) = pool_all(make_engine(tiny_model, max_num_batched_tokens=8), [ids], PoolingParams(pooling_type, False))
    reference = own_reference(tiny_model, ids, pooling_type, normalize=False)
    assert torch.allclose(torch.tensor(out.embedding, dtype=torch.float64), reference, rtol=1e-4, atol=1e-5)
    assert abs(reference.norm().item() - 1) > 0.01, "the raw state is not unit-length by chance"


@pytest.mark.slow
def test_pooling_through_a_preemption_mid_prompt(tiny_model):
    """A pool that holds one of the two: the pooling request (the newer) is preempted while its prompt
    is half done, recomputes it, and no position is counted twice."""
    ids_gen, ids_pool = prompt_ids(4, seed=3), prompt_ids(26, seed=4)
    engine = make_engine(tiny_model, num_blocks=9, block_size=4, max_num_batched_tokens=6)
    engine.add_request("gen", prompt_token_ids=ids_gen, params=SamplingParams(max_tokens=28, ignore_eos=True))
    engine.add_pooling_requests(["pool"], [ids_pool], PoolingParams("mean"))
    request = engine.requests["pool"]
    preempted_pending = []
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
        if request.status == RequestStatus.PREEMPTED:
            preempted_pending.append(request.pooling.folded)
        engine.block_manager.check_invariants()
    assert any(0 < folded < len(ids_pool) for folded in preempted_pending), preempted_pending
    assert request.pooling.folded == len(ids_pool)
    assert cosine(request.pooling.vector(), own_reference(tiny_model, ids_pool, "mean")) >= SAME_MODEL_MIN_COSINE
    assert_all_blocks_free(engine)


@pytest.mark.slow
def test_pooling_through_the_native_decode_step():
    """Outside --enforce-eager, single-token rows run through the native decode step; a budget of
    one token makes every pooling chunk such a row: the states it returns are final-normed too. 4-bit weights
    on our kernel, not timed: whether our fp32 kernel or MKL serves fp32 layers is this machine's choice."""
    engine = create_engine(
        "random:tiny",
        EngineConfig(num_blocks=64, max_num_batched_tokens=1, max_model_len=256),
        enforce_eager=False,
        quantization=QuantConfig("int4", kernel="int8x2"),
    )
    assert engine.loaded.model.native_step is not None
    prompts = [prompt_ids(n, seed=n) for n in (1, 6, 11)]
    for pooling_type in ("last", "mean"):
        for ids, out in zip(prompts, pool_all(engine, prompts, PoolingParams(pooling_type))):
            assert cosine(out.embedding, own_reference(engine.loaded, ids, pooling_type)) >= SAME_MODEL_MIN_COSINE
    assert_all_blocks_free(engine)


@pytest.mark.slow
def test_a_generation_beside_pooling_requests_is_unchanged(tiny_model):
    """Pooling chunks yield no logits rows: a neighbour's sampled rows must not shift."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    ids = prompt_ids(6, seed=8)
    alone = make_engine(tiny_model, max_num_batched_tokens=16)
    alone.add_request("gen", prompt_token_ids=ids, params=params)
    reference = run_engine(alone)["gen"].outputs[0]
    engine = make_engine(tiny_model, max_num_batched_tokens=16)
    engine.add_request("gen", prompt_token_ids=ids, params=params)

    def add_pooling(step: int) -> None:  # once the prompt ran: pooling chunks share the decode steps
        if step == 1:
            engine.add_pooling_requests(["a", "b"], [prompt_ids(40, seed=1), [7]], PoolingParams("last"))

    done = run_engine(engine, add_pooling)
    assert first_part_at_a_near_tie(reference, done["gen"].outputs[0]) is None
    assert isinstance(done["a"], PoolingRequestOutput) and isinstance(done["b"], PoolingRequestOutput)
    assert_all_blocks_free(engine)


@pytest.mark.slow
def test_the_event_log_folds_to_the_snapshots_with_pooling_requests(tiny_model):
    """The dashboard's view: pooling requests arrive (their pooling shown), prefill in chunks beside a
    generation and finish; the events folded onto any snapshot give the next one."""
    engine = make_engine(tiny_model, num_blocks=24, block_size=4, max_num_batched_tokens=8)
    log = EventLog(engine)
    engine.add_request("gen", prompt_token_ids=prompt_ids(5), params=SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_pooling_requests(["a", "b"], [prompt_ids(30, seed=1), prompt_ids(9, seed=2)], PoolingParams("mean"))
    snapshots = [engine.snapshot()]
    while engine.has_work():
        engine.step()
        snapshots.append(engine.snapshot())
    for early, late in zip(snapshots, snapshots[1:]):
        compare(fold(early, [e for e in engine.bus.history if early.seq < e.seq <= late.seq]), late)
    arrived = {e.request_id: e for e in log.of(ev.RequestArrived)}
    assert arrived["a"].sampling == {"pooling": "mean, normalized"} and arrived["a"].max_tokens == 0
    finished = {e.request_id: e for e in log.of(ev.RequestStateChanged) if e.state == "FINISHED"}
    assert set(finished) == {"gen", "a", "b"}
    assert_all_blocks_free(engine)


def test_pooling_requests_are_checked_all_or_none(tiny_model):
    engine = make_engine(tiny_model, max_model_len=64, num_blocks=32)
    vocab = tiny_model.config.vocab_size
    cases = [
        ([[5, 6], [vocab]], "prompt 1: prompt token id"),
        ([[5], []], "prompt 1: the prompt is empty"),
        ([[5] * 65], "more than this model's maximum context length"),
    ]
    for prompts, words in cases:
        with pytest.raises(RequestRejectedError, match=words) as err:
            engine.add_pooling_requests([f"r{i}" for i in range(len(prompts))], prompts, PoolingParams())
        assert err.value.param == "prompt"
        assert not engine.requests, "a rejected batch queues none of its prompts"
    with pytest.raises(ValueError, match="pooling_type"):
        engine.add_pooling_requests(["r"], [[5]], PoolingParams("max"))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_pooling_requests(["same", "same"], [[5], [6]], PoolingParams())
    (out,) = pool_all(engine, [prompt_ids(64)], PoolingParams())  # a prompt may fill the whole context
    assert len(out.embedding) == tiny_model.config.hidden_size
    assert_all_blocks_free(engine)


def test_embeddings_run_beside_a_generation_stream(tiny_model):
    """Through the AsyncEngine: a batch of embeddings requested while a stream generates. Every
    step that runs a pooling chunk also decodes the stream's next token (bounded by the token
    budget), the stream goes on after the embeddings are done, and no block is left behind."""
    engine = make_engine(tiny_model, max_num_batched_tokens=16, max_num_seqs=8)
    log = EventLog(engine)
    ae = AsyncEngine(engine).start()
    prompts = [prompt_ids(n, seed=n) for n in (120, 45, 3)]

    async def scenario():
        stream = ae.generate(
            None, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), "gen", prompt_token_ids=prompt_ids(5)
        )
        await anext(stream)  # generating now
        outs = await ae.embed(prompts, PoolingParams("mean"), "emb")
        after = [out async for out in stream]
        return outs, after

    try:
        outs, after = asyncio.run(scenario())
        assert after and after[-1].finished, "the stream was still generating when the embeddings were done"
        for ids, out in zip(prompts, outs):
            assert out.prompt_token_ids == ids
            assert cosine(out.embedding, own_reference(tiny_model, ids, "mean")) >= SAME_MODEL_MIN_COSINE
        pooling_steps = [e for e in log.of(ev.StepScheduled) if any(c.request_id.startswith("emb") for c in e.prefill)]
        assert len(pooling_steps) >= sum(map(len, prompts)) // 16
        for step in pooling_steps:
            assert step.budget_used <= 16
            assert [c.request_id for c in step.decode] == ["gen"], step
        asyncio.run(ae.call(assert_all_blocks_free))
    finally:
        ae.shutdown()


def test_a_cancelled_embedding_call_aborts_its_requests(tiny_model):
    """A client that goes away (its task cancelled) aborts the inputs still running; their blocks are freed."""
    engine = make_engine(tiny_model, max_num_batched_tokens=4)
    ae = AsyncEngine(engine).start()

    async def scenario():
        task = asyncio.ensure_future(
            ae.embed([prompt_ids(200, seed=1), prompt_ids(150, seed=2)], PoolingParams(), "cancelled")
        )
        while not await ae.call(lambda e: any(r.seqs[0].num_computed for r in e.requests.values())):
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while await ae.call(lambda e: e.has_work()):
            await asyncio.sleep(0.005)
        await ae.call(assert_all_blocks_free)
        return await ae.embed([[5, 6, 7]], PoolingParams(), "after")

    try:
        (after,) = asyncio.run(scenario())
        assert after.request_id == "after" and len(after.embedding) == tiny_model.config.hidden_size
        finished = [r for r in engine.tracker.finished if r.request_id.startswith("cancelled")]
        assert [r.finish_reason for r in finished] == ["abort", "abort"]
    finally:
        ae.shutdown()


# ---- POST /v1/embeddings ---------------------------------------------------------------------


@pytest.fixture
def client(tmp_path):
    with TestClient(tiny_app(tmp_path)) as c:
        yield c


def embed(client, **body):
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_openai_client_float_and_base64(client):
    model = served_model()
    oai = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client, max_retries=0)
    texts = ["Hello there, how are you?", "A", "Paged attention reads the KV cache through block tables."]
    as_floats = oai.embeddings.create(model="random:tiny", input=texts, encoding_format="float")
    decoded = oai.embeddings.create(model="random:tiny", input=texts)  # the client asks for base64, decodes it
    raw = oai.embeddings.create(model="random:tiny", input=texts, encoding_format="base64")
    ids = [model.tokenizer.encode(t) for t in texts]
    assert as_floats.object == "list" and as_floats.model == "random:tiny"
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(map(len, ids))
    for i, item in enumerate(as_floats.data):
        assert item.index == i and item.object == "embedding"
        assert cosine(item.embedding, own_reference(model, ids[i], "last")) >= SAME_MODEL_MIN_COSINE
        assert decoded.data[i].embedding == item.embedding, "float32 values survive base64 exactly"
        packed = base64.b64decode(raw.data[i].embedding)
        assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == item.embedding


def test_token_ids_and_lists_of_them(client):
    model = served_model()
    ids = [prompt_ids(12, seed=1), prompt_ids(30, seed=2)]
    one = embed(client, input=ids[0])
    both = embed(client, input=ids)
    assert one["usage"]["prompt_tokens"] == 12 and both["usage"]["prompt_tokens"] == 42
    assert [d["index"] for d in both["data"]] == [0, 1]
    assert cosine(one["data"][0]["embedding"], own_reference(model, ids[0], "last")) >= SAME_MODEL_MIN_COSINE
    assert cosine(both["data"][1]["embedding"], own_reference(model, ids[1], "last")) >= SAME_MODEL_MIN_COSINE


def test_vllm_fields(client):
    model = served_model()
    ids = prompt_ids(40, seed=6)
    truncated = embed(client, input=ids, truncate_prompt_tokens=10)
    assert truncated["usage"]["prompt_tokens"] == 10
    last_ten = own_reference(model, ids[-10:], "last")
    assert cosine(truncated["data"][0]["embedding"], last_ten) >= SAME_MODEL_MIN_COSINE
    assert embed(client, input=ids, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == 40
    raw = embed(client, input=ids, normalize=False)["data"][0]["embedding"]
    reference = own_reference(model, ids, "last", normalize=False)
    assert torch.allclose(torch.tensor(raw, dtype=torch.float64), reference, rtol=1e-4, atol=1e-5)
    hidden = model.config.hidden_size
    named = embed(client, input=ids, dimensions=hidden, user="u", priority=-1, request_id="my-embedding-1")
    assert named["id"] == "embd-my-embedding-1" and len(named["data"][0]["embedding"]) == hidden


def test_chat_form_embeds_the_rendered_chat(client):
    model = served_model()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    rendered = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    out = embed(client, messages=messages)
    assert out["usage"]["prompt_tokens"] == len(rendered)
    assert cosine(out["data"][0]["embedding"], own_reference(model, rendered, "last")) >= SAME_MODEL_MIN_COSINE


@pytest.mark.slow
def test_mean_pooling_is_a_server_option(tmp_path):
    model = served_model()
    ids = prompt_ids(25, seed=9)
    with TestClient(tiny_app(tmp_path, embedding_pooling="mean")) as c:
        vector = embed(c, input=ids)["data"][0]["embedding"]
    assert cosine(vector, own_reference(model, ids, "mean")) >= SAME_MODEL_MIN_COSINE
    assert cosine(vector, own_reference(model, ids, "last")) < 0.99
    with pytest.raises(ValueError, match="embedding_pooling"):
        ServerConfig(engine=tiny_engine(), embedding_pooling="max")
    args = build_parser().parse_args(["serve", "--embedding-pooling", "mean"])
    assert args.embedding_pooling == "mean"
    assert build_parser().parse_args(["serve"]).embedding_pooling == "last"


BAD_REQUESTS = [
    ({"input": ""}, 400, "input", "empty string"),
    ({"input": []}, 400, "input", "must not be empty"),
    ({"input": ["fine", ""]}, 400, "input", "input 1 is an empty string"),
    ({"input": [[5, 6], []]}, 400, "input", "input 1 is an empty list"),
    ({"input": [5, "mixed"]}, 400, "input", "list of token ids"),
    ({"input": [49152]}, 400, "input", "out of range for vocabulary"),
    ({"input": [-1]}, 400, "input", "out of range for vocabulary"),
    ({"input": [[5], [7] * 513]}, 400, "input", "prompt 1: the prompt is 513 tokens long"),
    ({"input": "x", "model": "other"}, 404, "model", "does not exist"),
    ({"input": "x", "dimensions": 32}, 400, "dimensions", "matryoshka"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format", "'float', 'base64'"),
    ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "-1 or >= 1"),
    ({"input": "x", "truncate_prompt_tokens": 513}, 400, "truncate_prompt_tokens", "greater than"),
    ({"input": "x", "request_id": "not valid!"}, 400, "request_id", "request_id"),
    ({"input": "x", "temperature": 0.5}, 400, "temperature", "Unrecognized request argument"),
    ({"input": "x", "messages": []}, 400, "messages", "not both"),
    ({"model": "random:tiny"}, 400, "input", "needs `input`"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "role"),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "add_generation_prompt": True,
            "continue_final_message": True,
        },
        400,
        "continue_final_message",
        "cannot both be true",
    ),
]


@pytest.mark.parametrize("body,status,param,words", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_requests_are_openai_shaped_4xx(client, body, status, param, words):
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert embed(client, input="still serving")["data"], "the engine keeps serving"
    engine = server_of(client.app).async_engine
    asyncio.run(engine.call(assert_all_blocks_free))
