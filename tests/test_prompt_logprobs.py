"""vLLM's `prompt_logprobs` in the engine, and `echo`, `prompt_logprobs` and lists of prompts on
/v1/completions.

The reference for prompt log-probs is always computed: log_softmax of the fp32 logits of one plain
forward pass over the whole prompt (`scoring.forward_prefills`), at the position before each token.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine_utils import assert_all_blocks_free, make_engine, run
from minivllm.core.request import RequestStatus
from minivllm.engine.scoring import forward_prefills
from minivllm.sampling.params import SamplingParams

TOL = 1e-4


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def reference(loaded, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-probs: row p is the distribution of the token at p + 1."""
    return torch.log_softmax(forward_prefills(loaded, [ids])[0].float(), dim=-1)


def check_entries(out, ids: list[int], ref: torch.Tensor, top_n: int) -> None:
    entries, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    assert entries is not None and ranks is not None
    assert len(entries) == len(ranks) == len(ids), "one entry per prompt token, none twice"
    assert entries[0] is None and ranks[0] is None
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], entries[i]
        items = list(entry.items())
        assert items[0][0] == ids[i], "the prompt token comes first"
        assert abs(items[0][1] - row[ids[i]].item()) < TOL, (i, items[0][1], row[ids[i]].item())
        # rank: 1 + the tokens likelier than it (a random model's logits are flat: allow last-bit ties)
        lp = row[ids[i]]
        assert int((row > lp + TOL).sum()) + 1 <= ranks[i] <= int((row >= lp - TOL).sum()), i
        top_vals, top_ids = row.topk(top_n)
        expected = dict(zip(top_ids.tolist(), top_vals.tolist()))
        alternatives = dict(items[1:] if len(items) > top_n else items)
        assert set(alternatives) == set(expected), i
        for token, lp in alternatives.items():
            assert abs(lp - expected[token]) < TOL
        assert len(entry) == top_n + (ids[i] not in expected)


# ---- the engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [512, 7, 1], ids=["one-chunk", "chunks-of-7", "one-token-chunks"])
@pytest.mark.parametrize("top_n", [0, 3])
def test_prompt_logprobs_equal_a_full_forward_pass(tiny_model, budget, top_n):
    ids = prompt_ids(23)
    engine = make_engine(tiny_model, block_size=4, max_num_batched_tokens=budget)
    engine.add_request("r", prompt_token_ids=ids, params=SamplingParams(max_tokens=3, prompt_logprobs=top_n))
    outs = run(engine)
    check_entries(outs["r"], ids, reference(tiny_model, ids), top_n)
    assert_all_blocks_free(engine)


def test_prompt_logprobs_come_with_the_first_output_only(tiny_model):
    ids = prompt_ids(10)
    engine = make_engine(tiny_model, block_size=4, max_num_batched_tokens=4)
    engine.add_request(
        "r", prompt_token_ids=ids, params=SamplingParams(max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    )
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    assert len(deltas) == 4, "one output per generated token"
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == len(ids)
    assert all(d.prompt_logprobs is None and d.prompt_logprob_ranks is None for d in deltas[1:])


def test_a_one_token_prompt_has_one_none_entry(tiny_model):
    engine = make_engine(tiny_model)
    engine.add_request("r", prompt_token_ids=[5], params=SamplingParams(max_tokens=2, prompt_logprobs=2))
    out = run(engine)["r"]
    assert out.prompt_logprobs == [None] and out.prompt_logprob_ranks == [None]


def test_prompt_logprobs_skip_prefix_cache_hits_but_publish_their_blocks(tiny_model):
    ids = prompt_ids(30, seed=1)
    ref = reference(tiny_model, ids)
    engine = make_engine(tiny_model, block_size=4, enable_prefix_caching=True)
    engine.add_request("plain", prompt_token_ids=ids, params=SamplingParams(max_tokens=2))
    assert run(engine)["plain"].metrics.num_cached_tokens == 0
    # the whole prompt is cached now; a request that wants prompt log-probs computes it all again
    engine.add_request("logprobs", prompt_token_ids=ids, params=SamplingParams(max_tokens=2, prompt_logprobs=2))
    out = run(engine)["logprobs"]
    assert out.metrics.num_cached_tokens == 0
    check_entries(out, ids, ref, 2)
    assert engine.stats().prefix_cache_hits == 0

    other = prompt_ids(30, seed=2)
    engine.add_request("first", prompt_token_ids=other, params=SamplingParams(max_tokens=2, prompt_logprobs=0))
    run(engine)
    engine.add_request("again", prompt_token_ids=other, params=SamplingParams(max_tokens=2))
    assert run(engine)["again"].metrics.num_cached_tokens == 28, "blocks computed for prompt log-probs are cached"
    assert_all_blocks_free(engine)


def test_prompt_logprobs_through_preemption_mid_prompt_and_after(tiny_model):
    """A pool that holds one of the two: the newer request is preempted (recompute), once while its
    prompt is half done and again while it decodes; no entry is lost or doubled."""
    ids_a, ids_b = prompt_ids(4, seed=3), prompt_ids(26, seed=4)
    engine = make_engine(tiny_model, num_blocks=9, block_size=4, max_num_batched_tokens=6)
    engine.add_request("a", prompt_token_ids=ids_a, params=SamplingParams(max_tokens=28, ignore_eos=True))
    b = engine.add_request(
        "b", prompt_token_ids=ids_b, params=SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    )
    preempted_while = []

    def watch(_):
        if b.status == RequestStatus.PREEMPTED and (not preempted_while or preempted_while[-1][1] != b.num_preemptions):
            preempted_while.append((b.prompt_logprobs.pending, b.num_preemptions))

    outs = run(engine, on_step=watch)
    assert any(pending for pending, _ in preempted_while), preempted_while
    assert outs["b"].metrics.num_preemptions >= 1
    check_entries(outs["b"], ids_b, reference(tiny_model, ids_b), 2)
    assert outs["a"].prompt_logprobs is None
    assert_all_blocks_free(engine)


def test_requests_without_prompt_logprobs_are_unaffected(tiny_model):
    """The same greedy tokens and logprobs with or without a neighbour that asks for prompt log-probs,
    and the neighbour's own sampled tokens are those it draws without asking."""
    prompts = [prompt_ids(n, seed=10 + n) for n in (9, 17, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run_all(with_prompt_logprobs: bool):
        engine = make_engine(tiny_model, block_size=4, max_num_batched_tokens=12)
        for i, ids in enumerate(prompts):
            p = params
            if i == 1 and with_prompt_logprobs:
                p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=4)
            engine.add_request(f"r{i}", prompt_token_ids=ids, params=p)
        return run(engine)

    plain, mixed = run_all(False), run_all(True)
    for i in range(len(prompts)):
        a, b = plain[f"r{i}"].outputs[0], mixed[f"r{i}"].outputs[0]
        # the neighbour's prompt tokens weigh more in the token budget, so the steps batch differently:
        # the same tokens, log-probs equal up to the float rounding of another batch shape
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)
    assert all(mixed[f"r{i}"].prompt_logprobs is None for i in (0, 2))
    check_entries(mixed["r1"], prompts[1], reference(tiny_model, prompts[1]), 4)


def test_prompt_logprobs_with_several_samples_and_beams(tiny_model):
    ids = prompt_ids(13, seed=5)
    ref = reference(tiny_model, ids)
    engine = make_engine(tiny_model, block_size=4, max_num_batched_tokens=5)
    engine.add_request(
        "n", prompt_token_ids=ids, params=SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=1)
    )
    engine.add_request(
        "beam", prompt_token_ids=ids, params=SamplingParams(n=2, use_beam_search=True, max_tokens=4, prompt_logprobs=1)
    )
    outs = run(engine)
    for name in ("n", "beam"):
        assert len(outs[name].outputs) in (2, 3)
        check_entries(outs[name], ids, ref, 1)
    assert_all_blocks_free(engine)


def test_prompt_logprob_tokens_count_for_their_cost_in_the_step_budget(tiny_model):
    """A pending prompt-logprobs token costs the layers plus the LM head and the vocabulary's
    reductions: on random:tiny (layers of ~100k multiply-adds, a 49,152 x 64 head) 49 plain tokens, on
    SmolLM2-135M's shape 2. Its chunk shrinks to fit; the rest of the budget goes to the others."""
    from types import SimpleNamespace

    from minivllm.engine.prompt_logprob_pass import token_cost

    smollm2 = SimpleNamespace(
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        vocab_size=49152,
    )
    assert token_cost(smollm2) == 2 and token_cost(tiny_model.config) == 49
    engine = make_engine(tiny_model, max_num_batched_tokens=128)
    engine.add_request(
        "scored", prompt_token_ids=prompt_ids(300, seed=1), params=SamplingParams(max_tokens=1, prompt_logprobs=1)
    )
    engine.add_request("plain", prompt_token_ids=prompt_ids(300, seed=2), params=SamplingParams(max_tokens=1))
    chunks = {s.seq.request.request_id: s.num_tokens for s in engine.scheduler.schedule().scheduled}
    assert chunks == {"scored": 128 // 49, "plain": 128 - 49 * (128 // 49)}


def test_entries_are_reduced_in_bounded_passes(tiny_model, monkeypatch):
    """A long chunk's logits are computed a few rows at a time: the same entries."""
    from minivllm.engine import prompt_logprob_pass as module

    ids = prompt_ids(40, seed=6)
    vocab = tiny_model.config.vocab_size
    monkeypatch.setattr(module, "LOGITS_PER_PASS", vocab * 3)  # 3 rows per pass
    engine = make_engine(tiny_model, block_size=4)
    engine.add_request("r", prompt_token_ids=ids, params=SamplingParams(max_tokens=1, prompt_logprobs=2))
    check_entries(run(engine)["r"], ids, reference(tiny_model, ids), 2)


# ---- /v1/completions -------------------------------------------------------------------------

GREEDY = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from litestar.testing import TestClient
    from test_server_support import tiny_app

    with TestClient(tiny_app(tmp_path_factory.mktemp("server"))) as c:
        yield c


def engine_of(client):
    from test_server_support import server_of

    return server_of(client.app).async_engine.engine


def post(client, **body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, **body) -> list[dict]:
    from test_server_support import sse_events

    r = client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def streamed_choices(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: the text and logprobs lists the chunks add up to, and its finish_reason."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            whole = out.setdefault(
                c["index"],
                {
                    "text": "",
                    "tokens": [],
                    "token_logprobs": [],
                    "top_logprobs": [],
                    "text_offset": [],
                    "finish_reason": None,
                    "chunks": 0,
                },
            )
            whole["text"] += c["text"]
            whole["chunks"] += 1
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                whole[key] += (c["logprobs"] or {}).get(key, [])
            whole["finish_reason"] = c["finish_reason"] or whole["finish_reason"]
    return out


def test_echo_returns_the_prompt_before_the_completion(client):
    plain = post(client, prompt=PROMPT, **GREEDY)["choices"][0]["text"]
    (choice,) = post(client, prompt=PROMPT, echo=True, **GREEDY)["choices"]
    assert choice["text"] == PROMPT + plain and choice["logprobs"] is None
    chunks = stream(client, prompt=PROMPT, echo=True, **GREEDY)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT), "the first chunk carries the prompt"
    assert streamed_choices(chunks)[0]["text"] == PROMPT + plain
    # token ids: the prompt decoded
    ids = engine_of(client).tokenizer.encode(PROMPT)
    assert post(client, prompt=ids, echo=True, **GREEDY)["choices"][0]["text"] == PROMPT + plain


def test_echo_with_logprobs_covers_the_prompt_tokens(client):
    tokenizer = engine_of(client).tokenizer
    ids = tokenizer.encode(PROMPT)
    plain = post(client, prompt=PROMPT, logprobs=2, **GREEDY)["choices"][0]
    scored = post(client, prompt=PROMPT, prompt_logprobs=2, **GREEDY)["choices"][0]["prompt_logprobs"]
    body = post(client, prompt=PROMPT, echo=True, logprobs=2, **GREEDY)
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == n + 5 and body["usage"]["completion_tokens"] == 5
    assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, "OpenAI: the first token has none"
    for i in range(1, n):
        expected = scored[i][str(ids[i])]["logprob"]
        assert lp["token_logprobs"][i] == expected
        top = lp["top_logprobs"][i]
        assert top[lp["tokens"][i]] == expected and 2 <= len(top) <= 3
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(PROMPT)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert choice["text"] == PROMPT + plain["text"]

    got = streamed_choices(stream(client, prompt=PROMPT, echo=True, logprobs=2, **GREEDY))[0]
    assert got["text"] == choice["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert got[key] == lp[key], key


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    body = post(client, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    (choice,) = body["choices"]
    n = body["usage"]["prompt_tokens"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == n and body["usage"]["completion_tokens"] == 0
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])
    got = streamed_choices(stream(client, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0))[0]
    assert got["text"] == PROMPT and got["tokens"] == choice["logprobs"]["tokens"]
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_in_vllm_shape(client):
    engine = engine_of(client)
    ids = engine.tokenizer.encode(PROMPT)
    ref = reference(engine.loaded, ids)
    body = post(client, prompt=PROMPT, prompt_logprobs=3, n=2, **GREEDY)
    assert len(body["choices"]) == 2
    plp = body["choices"][0]["prompt_logprobs"]
    assert body["choices"][1]["prompt_logprobs"] == plp, "every sample of a prompt carries its prompt's"
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        keys = list(entry)
        assert keys[0] == str(ids[i]), "the prompt token first"
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert abs(entry[keys[0]]["logprob"] - ref[i - 1][ids[i]].item()) < TOL
        assert entry[keys[0]]["decoded_token"] == engine.tokenizer.decode([ids[i]])
        alternatives = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] <= 3 and k != keys[0])
        top_ids = ref[i - 1].topk(3).indices.tolist()
        assert [t for _, t in alternatives] == [t for t in top_ids if t != ids[i]]
        assert len(entry) in (3, 4)
    assert post(client, prompt=PROMPT, **GREEDY)["choices"][0]["prompt_logprobs"] is None
    # 0 with stream is accepted (vLLM's rule) and adds nothing to the chunks
    chunks = stream(client, prompt=PROMPT, prompt_logprobs=0, **GREEDY)
    assert all(c["prompt_logprobs"] is None for chunk in chunks for c in chunk["choices"])


def test_a_list_of_prompts_runs_one_request_each(client):
    prompts = [PROMPT, "Once upon a time"]
    alone = [post(client, prompt=p, **GREEDY) for p in prompts]
    body = post(client, prompt=prompts, n=2, **GREEDY)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [alone[0]["choices"][0]["text"]] * 2 + [
        alone[1]["choices"][0]["text"]
    ] * 2
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == 4 * 5 and usage["total_tokens"] == usage["prompt_tokens"] + 20
    assert body["timings"]["generated_tokens"] == 20

    chunks = stream(client, prompt=prompts, n=2, echo=True, stream_options={"include_usage": True}, **GREEDY)
    got = streamed_choices(chunks[:-1])
    assert sorted(got) == [0, 1, 2, 3]
    for index, choice in got.items():
        assert choice["text"] == prompts[index // 2] + alone[index // 2]["choices"][0]["text"]
        assert choice["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage

    tokenizer = engine_of(client).tokenizer
    by_ids = post(client, prompt=[tokenizer.encode(p) for p in prompts], **GREEDY)
    assert [c["text"] for c in by_ids["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert post(client, prompt=[PROMPT], **GREEDY)["choices"][0]["text"] == alone[0]["choices"][0]["text"]


def test_a_prompt_that_fails_aborts_the_others(client):
    """The second prompt cannot fit the context: a 400, and the first one's request (if it was
    added before the second was refused) ends as aborted, not by running to its end."""
    from test_server_support import wait_for

    from minivllm.events import types as ev

    engine = engine_of(client)
    for streaming in (False, True):
        rid = f"fails-{streaming}"
        r = client.post(
            "/v1/completions",
            headers={"X-Request-Id": rid},
            json={"prompt": ["fine", "word " * 600], "max_tokens": 400, "ignore_eos": True, "stream": streaming},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("prompt", "max_tokens")
        wait_for(lambda: not engine.requests, what="the other prompt's request to be aborted")
        arrived = [e for e in engine.bus.history if isinstance(e, ev.RequestArrived) and e.request_id == f"{rid}-0"]
        ends = [
            e.finish_reason
            for e in engine.bus.history
            if isinstance(e, ev.RequestStateChanged) and e.request_id == f"{rid}-0" and e.state == "FINISHED"
        ]
        assert ends == (["abort"] if arrived else [])


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "whole"])
def test_a_list_of_prompts_is_aborted_when_the_client_goes_away(tmp_path, streaming):
    import asyncio
    import time

    from litestar.testing import AsyncTestClient
    from test_server_disconnect import _call_and_disconnect
    from test_server_support import server_of, tiny_app, tiny_engine

    from minivllm.events import types as ev

    app = tiny_app(tmp_path, engine=tiny_engine())
    log: list = []
    payload = {
        "prompt": ["A long story", "Another long story"],
        "n": 2,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": streaming,
    }
    ids = ("leaver-0", "leaver-1")

    def both_generating(chunks) -> bool:
        tokens = [e.request_id for e in list(log) if isinstance(e, ev.TokenGenerated)]
        return all(tokens.count(i) >= 6 for i in ids)

    async def scenario():
        async with AsyncTestClient(app):
            ae = server_of(app).async_engine
            ae.submit(lambda e: e.bus.subscribe(log.append)).result()
            chunks = await _call_and_disconnect(app, "/v1/completions", payload, "leaver", both_generating)
            deadline = time.monotonic() + 30
            while await ae.call(lambda e: e.has_unfinished_requests()):
                assert time.monotonic() < deadline, "the requests were never aborted"
                await asyncio.sleep(0.005)
            free = await ae.call(lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks))
            return chunks, free

    chunks, (free, total) = asyncio.run(scenario())
    ends = {
        e.request_id: e.finish_reason for e in log if isinstance(e, ev.RequestStateChanged) and e.state == "FINISHED"
    }
    assert ends == {i: "abort" for i in ids}
    assert free == total
    if streaming:
        assert b"[DONE]" not in b"".join(chunks)
