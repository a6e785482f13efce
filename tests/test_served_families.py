"""Every family served through the real app, n-gram speculation on: one tiny random checkpoint a family (built
with transformers' own config class, saved with the embedded tokenizer), loaded through `create_engine` as
`minivllm serve --model DIR` does. Each answers a chat through its chat template, streams the same text, keeps a
JSON schema, and its speculative greedy tokens equal a plain engine's."""

from __future__ import annotations

import json

import jsonschema
import pytest
from litestar.testing import TestClient
from test_model_families import make_tiny
from test_model_family_gemma import GEMMA3_ROPE, make_tiny_gemma
from test_model_family_mistral import make_tiny_mistral
from test_model_family_moe import make_tiny_moe
from test_model_family_phi3 import make_tiny_phi3
from test_server_support import sse_events, tiny_app

from engine_utils import run
from minivllm.engine.config import EngineConfig
from minivllm.engine.factory import create_engine
from minivllm.sampling.params import SamplingParams

pytestmark = pytest.mark.slow  # eight checkpoints, each loaded twice

FAMILIES = {
    "qwen2": lambda d, t: make_tiny("Qwen2", d, t, tie_word_embeddings=True),
    "qwen3": lambda d, t: make_tiny("Qwen3", d, t, head_dim=32),
    "mistral": lambda d, t: make_tiny_mistral(d, t),
    "phi3": lambda d, t: make_tiny_phi3(d, t),
    "gemma2": lambda d, t: make_tiny_gemma("Gemma2", d, t),
    "gemma3": lambda d, t: make_tiny_gemma("Gemma3Text", d, t, rope_parameters=GEMMA3_ROPE),
    "qwen3-moe": lambda d, t: make_tiny_moe("Qwen3Moe", d, t, norm_topk_prob=True),
    "mixtral": lambda d, t: make_tiny_moe("Mixtral", d, t, num_local_experts=8, intermediate_size=64),
}
# not adaptive: drafts wherever prompt lookup finds a match, not where measured step costs say they pay
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
ANSWER = {
    "type": "object",
    "required": ["answer", "count"],
    "additionalProperties": False,
    "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
}
REPEATING = "one two three four one two three four one two three four one two"  # what prompt lookup drafts from


def engine_config() -> EngineConfig:
    return EngineConfig(num_blocks=64, max_num_seqs=4, max_model_len=96)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory, embedded_tokenizer):
    directory = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](directory, embedded_tokenizer)
    # our fp32 kernel at every row count: a verify chunk's rows get a decode row's bits (MKL's packs differ by
    # row count, and a near-tie could then part speculative tokens from plain ones)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MINIVLLM_FP32_KERNEL", "native")
        engine = create_engine(str(directory), engine_config(), speculative_config=NGRAM)
        with TestClient(tiny_app(tmp_path_factory.mktemp("app"), engine=engine)) as client:
            yield request.param, directory, client, engine


def chat(client, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": "Is it raining?"}], "max_tokens": 16, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body | fields)
    assert response.status_code in (200, 201), response.text
    return response.json() if not fields.get("stream") else sse_events(response.text)


def test_a_chat_goes_through_the_chat_template_and_streams_the_same_text(served):
    name, _, client, engine = served
    tokenizer = engine.tokenizer
    body = chat(client)
    messages = [{"role": "user", "content": "Is it raining?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert body["usage"]["prompt_tokens"] == len(prompt), name
    assert body["usage"]["completion_tokens"] > 0
    events = chat(client, stream=True)
    assert events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert streamed == body["choices"][0]["message"]["content"], name


def test_a_json_schema_is_kept(served):
    name, _, client, _ = served
    body = chat(
        client, max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    )
    assert body["choices"][0]["finish_reason"] == "stop", name
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), ANSWER)


def test_ngram_speculation_drafts_and_keeps_the_plain_greedy_tokens(served):
    """A bias toward the prompt's own tokens makes a random model reuse them, so prompt lookup always has
    something to draft; the greedy tokens still come from the model's logits, and must equal a plain engine's."""
    name, directory, client, engine = served
    tokenizer, before = engine.tokenizer, engine.stats().spec_num_draft_tokens
    ids = tokenizer.encode(REPEATING)
    bias = {token: 20.0 for token in set(ids)}
    request = {"prompt": ids, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logit_bias": bias}
    response = client.post("/v1/completions", json=request)
    assert response.status_code in (200, 201), response.text
    speculative = response.json()["choices"][0]["text"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MINIVLLM_FP32_KERNEL", "native")
        plain = create_engine(str(directory), engine_config())
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias=bias)
    plain.add_request("r", prompt_token_ids=ids, params=params)
    assert speculative == tokenizer.decode(run(plain)["r"].outputs[0].token_ids), name
    assert engine.stats().spec_num_draft_tokens > before, f"{name}: prompt lookup drafted nothing"
