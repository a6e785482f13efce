"""The OpenAI surface of structured outputs, tools and logit_bias (random:tiny behind the real app):
every way of asking for a constraint works, streaming included; malformed constraints and tools
are 400s naming the field and leave nothing behind; nothing in a request is silently dropped."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from litestar.testing import TestClient
from test_server_support import server_of, sse_events, tiny_app

SCHEMA = {
    "type": "object",
    "required": ["name", "age"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["city", "unit"],
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["zone"],
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
            },
        },
    },
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with TestClient(tiny_app(tmp_path_factory.mktemp("app"))) as c:
        yield c


def chat(client, status: int = 200, **fields):
    body = {
        "messages": [{"role": "user", "content": "Tell me about someone."}],
        "max_tokens": 80,
        "temperature": 1.0,
        "seed": 3,
        **fields,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    return r.json()


def text_of(body) -> str:
    return body["choices"][0]["message"]["content"]


def assert_nothing_left(client) -> None:
    engine = server_of(client.app).async_engine.engine
    assert not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "guidance"},
    ],
)
def test_json_schema_every_way_and_streaming(client, fields):
    body = chat(client, **fields)
    jsonschema.validate(json.loads(text_of(body)), SCHEMA)
    assert body["choices"][0]["finish_reason"] == "stop"
    events = sse_events(
        client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Tell me about someone."}],
                "max_tokens": 80,
                "temperature": 1.0,
                "seed": 3,
                "stream": True,
                **fields,
            },
        ).text
    )
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert streamed == text_of(body)


def test_strict_closes_objects_and_json_object_and_text(client):
    open_schema = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "maxLength": 8}}}
    strict = chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": open_schema, "strict": True}},
    )
    assert list(json.loads(text_of(strict))) == ["name"]
    # any object: a random model never closes one by itself, so a logit_bias (applied before the mask) helps it
    close = server_of(client.app).async_engine.engine.tokenizer.convert_tokens_to_ids("}")
    any_object = chat(client, response_format={"type": "json_object"}, logit_bias={str(close): 8})
    assert isinstance(json.loads(text_of(any_object)), dict)
    free = chat(client, response_format={"type": "text"}, max_tokens=12)
    assert free["choices"][0]["finish_reason"] == "length"


def test_regex_choice_and_grammar_fields(client):
    for seed in range(5):
        assert re.fullmatch(
            r"[A-Z][a-z]{2,5} [0-9]{2}", text_of(chat(client, seed=seed, guided_regex=r"[A-Z][a-z]{2,5} [0-9]{2}"))
        )
        assert text_of(chat(client, seed=seed, guided_choice=["red", "green"])) in ("red", "green")
        assert text_of(chat(client, seed=seed, structured_outputs={"choice": ["up", "down"]})) in ("up", "down")
        assert re.fullmatch(r"x+", text_of(chat(client, seed=seed, guided_grammar='start: "x"+')))
        assert text_of(chat(client, seed=seed, guided_grammar='root ::= "a" | "b"')) in ("a", "b")
    completion = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "guided_choice": ["on", "off"]})
    assert completion.json()["choices"][0]["text"] in ("on", "off")


def test_n_samples_with_a_schema(client):
    body = chat(client, n=3, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert len(body["choices"]) == 3
    for choice in body["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.parametrize(
    "fields, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
            "invalid JSON schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regular expression"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "the list of choices is empty"),
        ({"guided_choice": []}, "guided_choice", "the list of choices is empty"),
        ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "invalid grammar"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "set only one"),
        ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
        ({"guided_regex": "a", "use_beam_search": True, "n": 2}, "structured_outputs", "beam search"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools",
            "invalid",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "same name"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "out of range"),
    ],
)
def test_bad_constraints_are_400s_that_leave_nothing_behind(client, fields, param, message):
    error = chat(client, 400, **fields)["error"]
    assert error["param"] == param and message in error["message"], error
    assert_nothing_left(client)
    assert text_of(chat(client, guided_choice=["still", "serving"])) in ("still", "serving")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"some_unknown_field": 1}, "some_unknown_field"),
        ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages[0].colour"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schemaa": {}}}},
            "response_format.json_schema.schemaa",
        ),
        ({"stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
    ],
)
def test_unknown_fields_are_refused_by_name(client, fields, param):
    error = chat(client, 400, **fields)["error"]
    assert error == {
        "message": f"Unrecognized request argument supplied: {param}",
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
            "messages",
        ),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused(client, fields, param):
    assert chat(client, 400, **fields)["error"]["param"] == param


def test_completions_refuse_what_they_cannot_honour(client):
    for fields, param in [({"suffix": "x"}, "suffix"), ({"best_of": 0}, "best_of"), ({"foo": 1}, "foo")]:
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "best_of": 1, "user": "u"})
    assert ok.status_code == 200, ok.text


def test_bookkeeping_fields_are_accepted_as_no_ops(client):
    plain = chat(client, max_tokens=8, temperature=0)
    noted = chat(
        client,
        max_tokens=8,
        temperature=0,
        user="u1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        safety_identifier="s",
        prompt_cache_key="c",
        reasoning_effort="low",
        verbosity="low",
        modalities=["text"],
        parallel_tool_calls=True,
        stream_options=None,
        messages=[{"role": "user", "content": "Tell me about someone.", "name": "ann"}],
    )
    assert text_of(noted) == text_of(plain)


def test_logit_bias_through_the_api(client):
    forced = chat(client, temperature=0, max_tokens=4, logit_bias={"77": 100})
    tokenizer = server_of(client.app).async_engine.engine.tokenizer
    assert text_of(forced) == tokenizer.decode([77] * 4)
    plain = chat(client, temperature=0, max_tokens=4, logprobs=True)
    first = plain["choices"][0]["logprobs"]["content"][0]["token"]
    first_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(first))[0]
    banned = chat(client, temperature=0, max_tokens=4, logit_bias={str(first_id): -100})
    assert not text_of(banned).startswith(first)


def _args_valid(call, tools=TOOLS) -> dict:
    fn = next(t["function"] for t in tools if t["function"]["name"] == call["function"]["name"])
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, fn["parameters"])
    return args


def test_named_and_required_tool_choice_force_valid_calls(client):
    for seed in range(4):
        body = chat(client, seed=seed, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_time"
        _args_valid(call)
        required = chat(client, seed=seed, tools=TOOLS, tool_choice="required")  # one call unless parallel asked
        (call,) = required["choices"][0]["message"]["tool_calls"]
        _args_valid(call)


def test_parallel_required_calls_follow_the_grammar(client):
    import msgspec

    from minivllm.server import openai_protocol as p
    from minivllm.server.tools import tool_plan

    engine = server_of(client.app).async_engine.engine
    req = msgspec.convert(
        {"messages": [], "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True},
        p.ChatCompletionRequest,
    )
    matcher = engine.grammars.compile(tool_plan(req).grammar()).matcher()
    two = (
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    )
    for token in engine.tokenizer.encode(two, add_special_tokens=False):
        matcher.accept(token)
    bad = engine.grammars.compile(tool_plan(req).grammar()).matcher()
    with pytest.raises(ValueError, match="rejected"):
        for token in engine.tokenizer.encode(
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}', add_special_tokens=False
        ):
            bad.accept(token)


def test_streamed_tool_calls_arrive_as_openai_deltas(client):
    body = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 80,
        "temperature": 1.0,
        "seed": 1,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "stream": True,
    }
    events = sse_events(client.post("/v1/chat/completions", json=body).text)
    deltas = [d for e in events[:-1] if e["choices"] for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert len(deltas) == 1 and deltas[0]["index"] == 0 and deltas[0]["function"]["name"] == "get_weather"
    _args_valid(deltas[0])
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert not "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])


def test_tool_turns_in_the_conversation_reach_the_prompt(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    ids = client.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    prompt = server_of(client.app).async_engine.engine.tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\n12:00<|im_end|>" in prompt and "<tools>" in prompt
    assert chat(client, messages=messages, tools=TOOLS, max_tokens=5)["choices"][0]["finish_reason"]
    # tool_choice none: the tools are not offered at all
    ids_none = client.post(
        "/v1/chat/completions", json={"messages": messages[:1], "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
    ).json()
    assert ids_none["usage"]["prompt_tokens"] < len(ids)


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client):
    body = chat(client, max_tokens=2, temperature=0, prompt_logprobs=2)
    entries = body["prompt_logprobs"]
    assert entries[0] is None and len(entries) == body["usage"]["prompt_tokens"]
    assert all(len(e) >= 2 and all(v["logprob"] <= 0 for v in e.values()) for e in entries[1:])
    assert chat(client, max_tokens=2)["prompt_logprobs"] is None
    assert chat(client, 400, stream=True, prompt_logprobs=1)["error"]["param"] == "prompt_logprobs"
