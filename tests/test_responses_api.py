"""/v1/responses through the official openai client against the real app (Litestar's TestClient as
the client's transport): random:tiny where the shapes are the point, the embedded SmolLM2 where a
greedy response must equal the chat completion of the same conversation. The store's bound and
expiry are unit-tested with a fake clock."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from litestar.testing import TestClient
from test_server_disconnect import _run_scenario, _tokens
from test_server_support import server_of, tiny_app

from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.server.response_store import ResponseStore, StoredResponse

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER,
        "strict": True,
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    }
]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


def _openai(test_client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver.local/v1", api_key="unused", http_client=test_client, max_retries=0
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with TestClient(tiny_app(tmp_path_factory.mktemp("app"))) as test_client:
        yield test_client, _openai(test_client)


@pytest.fixture(scope="module")
def smol(tmp_path_factory, embedded_model_q4):
    engine = LLMEngine(embedded_model_q4, EngineConfig(num_blocks=64, max_num_seqs=4, max_model_len=1024))
    with TestClient(tiny_app(tmp_path_factory.mktemp("smol"), engine)) as test_client:
        yield test_client, _openai(test_client)


def assert_nothing_left(test_client) -> None:
    engine = server_of(test_client.app).async_engine.engine
    assert not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- the same conversation as a chat completion (the embedded model) ---------------------------


def _chat(client, messages, max_tokens):
    return client.chat.completions.create(model="", temperature=0, max_completion_tokens=max_tokens, messages=messages)


# Each comparison runs the chat request once before: then both sides find the same prompt blocks in
# the prefix cache. A cold prefill and a cached one round differently, which flips this model's
# near-ties ("The" and "B" 0.009 nats apart on the first token below).


def test_greedy_response_equals_the_chat_completion(smol):
    _, client = smol
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    _chat(client, messages, 24)
    response = client.responses.create(
        model=None,
        instructions="You are a terse assistant.",
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=24,
    )
    chat = _chat(client, messages, 24)
    assert response.usage.input_tokens_details.cached_tokens == chat.usage.prompt_tokens_details.cached_tokens
    assert response.output_text and response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []


def test_previous_response_id_continues_the_conversation(smol):
    _, client = smol
    first = client.responses.create(
        model="",
        instructions="Answer in one short sentence.",
        input="Name a fruit.",
        temperature=0,
        max_output_tokens=16,
    )
    # instructions are not carried over (OpenAI's rule): the follow-up's conversation has no system turn
    messages = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name another one."},
    ]
    _chat(client, messages, 16)
    second = client.responses.create(
        model="", previous_response_id=first.id, input="Name another one.", temperature=0, max_output_tokens=16
    )
    chat = _chat(client, messages, 16)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


# ---- streaming ------------------------------------------------------------------------------------


def test_streamed_events_come_in_order_and_the_deltas_join_to_the_text(tiny):
    test_client, client = tiny
    events = list(
        client.responses.create(model="", input="Tell me a story.", max_output_tokens=8, temperature=1.0, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.output_text.delta"] * len(deltas)
        + [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
    )  # cut by max_output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == final.output_text
    assert final.output[0].id == events[2].item.id == deltas[0].item_id and final.output[0].status == "incomplete"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == text  # stored once finished
    assert_nothing_left(test_client)


def test_stream_helper_and_parse_with_a_pydantic_model(tiny):
    _, client = tiny
    for _ in range(2):
        parsed = client.responses.parse(
            model="", input="Describe someone.", text_format=Person, temperature=1.0, max_output_tokens=80
        )
        assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
        jsonschema.validate(json.loads(parsed.output_text), Person.model_json_schema())
    with client.responses.stream(
        model="", input="Describe someone.", text_format=Person, temperature=1.0, max_output_tokens=80
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and isinstance(final.output_parsed, Person)
    assert final.text.format.type == "json_schema" and final.text.format.strict is True


def test_json_object_format_gives_a_json_object(tiny):
    _, client = tiny
    response = client.responses.create(
        model="", input="JSON please.", text={"format": {"type": "json_object"}}, temperature=1.0, max_output_tokens=60
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # cut short: still an object's beginning
        assert response.output_text.startswith("{")


# ---- tools -------------------------------------------------------------------------------------


def _call_args(item) -> dict:
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    assert item.id.startswith("fc_") and item.status == "completed"
    args = json.loads(item.arguments)
    jsonschema.validate(args, WEATHER)
    return args


def test_required_tool_choice_gives_a_valid_function_call(tiny):
    _, client = tiny
    for _ in range(3):
        response = client.responses.create(
            model="",
            input="Weather in Oslo?",
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            max_output_tokens=80,
        )
        (call,) = response.output
        _call_args(call)
        assert response.status == "completed" and response.tools[0].name == "get_weather"
    named = client.responses.create(
        model="",
        input="Weather?",
        tools=TOOLS,
        temperature=1.0,
        max_output_tokens=80,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    _call_args(named.output[0])


def test_streamed_function_call_events(tiny):
    _, client = tiny
    events = list(
        client.responses.create(
            model="",
            input="Weather in Oslo?",
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            max_output_tokens=80,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.arguments == "" and events[2].item.status == "in_progress"
    assert events[3].delta == events[4].arguments == events[5].item.arguments
    _call_args(events[5].item)
    assert events[-1].response.output[0].call_id == events[5].item.call_id


def test_function_call_output_round_trip_reaches_the_prompt(tiny):
    test_client, client = tiny
    asked = client.responses.create(
        model="", input="Weather in Oslo?", tools=TOOLS, tool_choice="required", temperature=1.0, max_output_tokens=80
    )
    call = asked.output[0]
    follow_up = [
        {"role": "user", "content": "Weather in Oslo?"},
        call,
        {"type": "function_call_output", "call_id": call.call_id, "output": "7 degrees, rain"},
    ]
    answer = client.responses.create(model="", input=follow_up, tools=TOOLS, temperature=0, max_output_tokens=4)
    assert answer.output[0].type == "message"
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "7 degrees, rain"},
    ]
    ids = test_client.post("/tokenize", json={"messages": messages, "tools": CHAT_TOOLS}).json()["tokens"]
    assert answer.usage.input_tokens == len(ids)
    prompt = server_of(test_client.app).async_engine.engine.tokenizer.decode(ids)
    assert "7 degrees, rain" in prompt and f'"arguments": {json.dumps(json.loads(call.arguments))}' in prompt


# ---- the store ---------------------------------------------------------------------------------


def test_retrieve_delete_and_store_false(tiny):
    _, client = tiny
    kept = client.responses.create(model="", input="Hi", max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(kept.id)
    assert got.id == kept.id and got.output_text == kept.output_text and got.metadata == {"k": "v"}
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model="", input="And?", previous_response_id=kept.id, max_output_tokens=3)
    assert gone.value.param == "previous_response_id" and gone.value.code == "previous_response_not_found"
    unstored = client.responses.create(model="", input="Hi", max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_output_items_sent_back_as_input_equal_previous_response_id(tiny):
    _, client = tiny
    first = client.responses.create(model="", input="Hi", max_output_tokens=6, temperature=0)
    by_id = client.responses.create(
        model="", previous_response_id=first.id, input="More", max_output_tokens=6, temperature=0
    )
    by_items = client.responses.create(
        model="",
        input=[{"role": "user", "content": "Hi"}, *first.output, {"role": "user", "content": "More"}],
        max_output_tokens=6,
        temperature=0,
    )
    assert by_id.usage.input_tokens == by_items.usage.input_tokens > first.usage.input_tokens + 6
    assert by_id.output_text == by_items.output_text


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_drops_the_least_recently_used_beyond_its_bound():
    store = ResponseStore(max_count=2, ttl_s=100, clock=FakeClock())
    for name in ("a", "b"):
        store.put(name, StoredResponse(name, []))
    assert store.get("a").response == "a"  # a is now the most recently used
    store.put("c", StoredResponse("c", []))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_store_forgets_responses_after_their_ttl():
    clock = FakeClock()
    store = ResponseStore(max_count=10, ttl_s=60, clock=clock)
    store.put("old", StoredResponse("old", []))
    clock.now = 30
    store.put("new", StoredResponse("new", []))
    clock.now = 59.9
    assert store.get("old") is not None
    clock.now = 60
    assert store.get("old") is None and store.get("new") is not None
    clock.now = 90
    assert store.get("new") is None and len(store) == 0
    assert not store.delete("new")
    with pytest.raises(ValueError):
        ResponseStore(max_count=0)


def test_a_client_that_leaves_a_stream_aborts_its_response(tmp_path):
    payload = {"input": "Talk forever", "max_output_tokens": 400, "stream": True}
    chunks, log = _run_scenario(tmp_path, payload, "/v1/responses", lambda chunks, log: len(chunks) >= 6)
    body = b"".join(chunks)
    assert b"response.output_text.delta" in body and b"response.completed" not in body
    assert _tokens(log) < 400


def test_a_client_that_leaves_a_whole_response_aborts_it(tmp_path):
    payload = {"input": "Talk forever", "max_output_tokens": 400}
    _, log = _run_scenario(tmp_path, payload, "/v1/responses", lambda chunks, log: _tokens(list(log)) >= 5)
    assert _tokens(log) < 400


# ---- other fields ------------------------------------------------------------------------------


def test_logprobs_cover_the_output_tokens(tiny):
    _, client = tiny
    response = client.responses.create(
        model="",
        input="Hi",
        max_output_tokens=5,
        temperature=1.0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens == 5
    assert "".join(lp.token for lp in logprobs) == response.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


def test_truncation_auto_drops_the_oldest_turns(tiny):
    test_client, client = tiny
    long_history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 40} for i in range(12)
    ] + [{"role": "user", "content": "last question"}]
    with pytest.raises(openai.BadRequestError):  # the default (disabled): too long is a 400
        client.responses.create(model="", input=long_history, max_output_tokens=16)
    response = client.responses.create(
        model="", input=long_history, max_output_tokens=16, truncation="auto", instructions="Be brief."
    )
    assert response.truncation == "auto"
    assert response.usage.input_tokens <= 512 - 16
    assert_nothing_left(test_client)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"colour": "red"}, "colour", "Unrecognized request argument supplied: colour"),
        ({"tools": [{"type": "web_search"}]}, "tools", "built-in tool 'web_search'"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "tools", "function tools only"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input",
            "image inputs are not supported",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "colour": 1}]}]},
            "input",
            "Unrecognized request argument supplied: input[0].content[0].colour",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "not supported"),
        ({"background": True}, "background", "background responses are not supported"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
        ({"include": ["file_search_call.results"]}, "include", "file_search_call.results"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_tokens"),
        ({"temperature": -1}, "temperature", "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format", ""),
        ({"input": []}, "input", "at least one item"),
        ({"model": "gpt-4o"}, "model", "does not exist"),
    ],
)
def test_bad_requests_are_openai_shaped_400s_and_the_engine_keeps_serving(tiny, fields, param, words):
    test_client, client = tiny
    body = {"input": "Hi", "max_output_tokens": 4, **fields}
    r = test_client.post("/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"]
    assert client.responses.create(model="", input="still there?", max_output_tokens=2).status
    assert_nothing_left(test_client)


def test_no_op_fields_are_accepted(tiny):
    _, client = tiny
    response = client.responses.create(
        model="",
        input="Hi",
        max_output_tokens=2,
        user="u1",
        service_tier="auto",
        safety_identifier="s",
        prompt_cache_key="k",
        reasoning={"effort": "low"},
        include=["reasoning.encrypted_content"],
        parallel_tool_calls=False,
    )
    assert response.user == "u1" and response.parallel_tool_calls is False and response.status


def test_vllm_extras_reach_the_engine_and_plugin_fields_are_refused(tmp_path):
    """vLLM's Responses extras: request_id names the request, cache_salt isolates the prefix cache,
    seed makes a hot sample repeatable; the plug-in fields are 400s that say why."""
    with TestClient(tiny_app(tmp_path)) as http:

        def post(**fields):
            return http.post(
                "/v1/responses", json={"input": "Tell me a story about caches.", "max_output_tokens": 4, **fields}
            )

        named = post(request_id="resp-req-1")
        assert named.status_code == 200 and named.headers["x-request-id"] == "resp-req-1"
        first, again, other = (
            post(cache_salt=s).json()["usage"]["input_tokens_details"]["cached_tokens"]
            for s in ("salt-a", "salt-a", "salt-b")
        )
        assert first == 0 and again > 0 and other == 0
        hot = [post(temperature=1.5, seed=11).json()["output"][0]["content"][0]["text"] for _ in range(2)]
        assert hot[0] == hot[1]
        for name, value in (("mm_processor_kwargs", {"x": 1}), ("vllm_xargs", {"x": 1})):
            error = post(**{name: value}).json()["error"]
            assert error["param"] == name and "Unrecognized" not in error["message"]
