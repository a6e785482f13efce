"""What a client can send to hurt the server through constraints and prompt log-probs: a grammar
that can never finish, invalid GBNF, huge choice lists and a constraint whose parser gives up while
generating are 400s naming the field (never 500s, never a wrong answer); a 5,000-property schema
and prompt log-probs over a long prompt do not stall a streaming neighbour.

The stall tests drive the app through raw ASGI calls (TestClient buffers a streamed body), time
each SSE chunk of a greedy victim stream as the app sends it, and compare its largest gap beside
the attack with its largest gap beside a harmless request of the same shape, in the same test.
The margins are generous: the box these run on is shared and loaded."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from litestar.testing import AsyncTestClient, TestClient
from test_server_support import server_of, sse_events, tiny_app, tiny_engine

from minivllm.events import types as ev
from minivllm.events.recording import read_recording
from minivllm.structured.params import MAX_CONSTRAINT_CHARS

MARGIN_S = 0.5  # the largest victim gap may exceed its baseline by this much (the bound)
GAP_ATTEMPTS = 3  # measurements of a gap before a test says the attack stalls its neighbour


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with TestClient(tiny_app(tmp_path_factory.mktemp("app"))) as c:
        yield c


def chat(client, **fields):
    body = {
        "messages": [{"role": "user", "content": "Pick one."}],
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 5,
        **fields,
    }
    return client.post("/v1/chat/completions", json=body)


def assert_error(response, param: str | None, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    assert len(error["message"]) < 2000, "the error names the problem, not the parser's state and the grammar"


def assert_still_serving(client) -> None:
    engine = server_of(client.app).async_engine.engine
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert chat(client, guided_choice=["still", "serving"]).json()["choices"][0]["message"]["content"] in (
        "still",
        "serving",
    )


@pytest.mark.parametrize(
    "grammar, rules",
    [
        ('start: a\na: "x" a', "rule start, a can never finish"),  # right-recursive, no base case
        ('start: "x" start', "rule start can never finish"),  # every token forced, forever
        ('start: item\nitem: ("x" | "y") item', "rule start, item can never finish"),
        ('root ::= "a" root', "rule root can never finish"),  # GBNF: named as the client wrote it
    ],
)
def test_a_grammar_that_can_never_finish_is_a_400(client, grammar, rules):
    assert_error(chat(client, guided_grammar=grammar), "guided_grammar", "invalid grammar", rules, "base case")
    assert_still_serving(client)


def test_grammars_that_can_finish_still_run(client):
    for grammar in (
        'start: a\na: "x" a | "x"',
        'start: a\na: "x" a?',
        'root ::= "a" root | "b"',
        'start: "x"+ end\nend: "!"',
    ):
        r = chat(client, guided_grammar=grammar, max_tokens=8)
        assert r.status_code == 200, (grammar, r.text)


@pytest.mark.parametrize(
    "grammar, words",
    [
        ('root ::= "a"\nroot ::= "b"', ("rule root is defined more than once",)),  # the converter kept the last
        ('root ::= x\nx ::= "a"\nx ::= "b"', ("rule x is defined more than once",)),
        ("root ::= [z-a]", ("invalid grammar", "character class range")),
        ('root ::= "a" {99999999999}', ("invalid grammar", "too large")),
        ('root ::= "a" undefined-rule', ("invalid grammar", "undefined-rule")),
        ('root ::= ("a" | "b"', ("invalid grammar", "Expected ')'")),
    ],
)
def test_invalid_gbnf_is_a_400_naming_the_error(client, grammar, words):
    assert_error(chat(client, guided_grammar=grammar), "guided_grammar", *words)
    assert_still_serving(client)


def test_ten_thousand_choices_answer_one_of_them(client):
    choices = [f"option-{i}" for i in range(10_000)]
    r = chat(client, guided_choice=choices, temperature=0)
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["message"]["content"] in choices
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_a_constraint_over_the_bound_is_a_400_naming_it(client):
    choices = [f"option-{i}" for i in range(100_000)]
    assert_error(chat(client, guided_choice=choices), "guided_choice", f"{MAX_CONSTRAINT_CHARS:,}")
    schema = {
        "type": "object",
        "properties": {f"field_{i:05}": {"type": "string", "description": "x" * 40} for i in range(5_000)},
    }
    assert len(json.dumps(schema)) > MAX_CONSTRAINT_CHARS
    assert_error(
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
        "response_format",
        f"{MAX_CONSTRAINT_CHARS:,}",
    )
    assert_still_serving(client)


def _nested(depth: int) -> str:
    """A schema `depth` objects deep, as JSON text (too deep for Python's json to write)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


@pytest.mark.parametrize(
    "field, wrap, param",
    [
        (
            "response_format",
            '{{"type": "json_schema", "json_schema": {{"name": "d", "schema": {}, "strict": true}}}}',
            "response_format",
        ),
        ("guided_json", "{}", "guided_json"),
        ("structured_outputs", '{{"json": {}}}', "structured_outputs"),
        ("tools", '[{{"type": "function", "function": {{"name": "f", "parameters": {}}}}}]', "tools"),
    ],
)
def test_deep_schemas_are_400s_naming_the_field(client, field, wrap, param):
    """Whatever walks a schema recursively (strict mode's closing, Python's json, the chat template)
    would exhaust Python's recursion: a bound on nesting, and a body too deep to decode at all."""
    messages = '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4'
    for depth, expected_param, words in ((300, param, "more than 64 levels deep"), (5_000, None, "too deeply")):
        body = "{" + messages + f', "{field}": ' + wrap.format(_nested(depth)) + "}"
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert_error(r, expected_param, words)
    assert_still_serving(client)


# 2,100 alternatives as one Lark rule: valid, but each is an Earley item, and past llguidance's 2,000
# items a row its parser gives up once the rule is reached (the old choice form's 500)
WIDE = " | ".join(f'"w{i}"' for i in range(2_100))


@pytest.mark.parametrize("stream", [False, True])
def test_a_parser_limit_reached_at_the_first_token_is_a_400_naming_the_field(client, stream):
    r = chat(client, guided_grammar="start: " + WIDE, stream=stream)  # before any chunk: a plain 400, streamed too
    assert_error(r, "guided_grammar", "the constraint rejected token", "max is 2000")
    assert_still_serving(client)


def test_a_parser_limit_reached_mid_stream_is_an_error_event_naming_the_field(client):
    r = chat(client, guided_grammar=f"start: /[a-z]{{12,20}}/ wide\nwide: {WIDE}", stream=True, max_tokens=40)
    assert r.status_code == 200, r.text[:300]  # some text streamed first: the error arrives in the stream
    events = sse_events(r.text)
    assert any(e["choices"][0]["delta"].get("content") for e in events if isinstance(e, dict) and e.get("choices"))
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] == "[DONE]", events[-3:]
    assert errors[0]["param"] == "guided_grammar" and errors[0]["type"] == "invalid_request_error", errors
    assert "Too many items" in errors[0]["message"] or "max is 2000" in errors[0]["message"], errors
    assert_still_serving(client)


# ---- streams beside an attack ----------------------------------------------------------------------


def _scope(path: str, body: bytes) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"host", b"testserver"),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }


async def _asgi_post(app, path: str, payload: dict, times: list[float] | None = None) -> tuple[int, bytes]:
    """One request in this event loop (AsyncTestClient would run it on another thread and block this
    one until it is answered); the time each body chunk leaves the app goes into `times`."""
    body = json.dumps(payload).encode()
    sent, finished = False, asyncio.Event()
    status, chunks = 0, []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # the client stays until the body is complete
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if times is not None:
                times.append(time.monotonic())
        if message["type"] == "http.response.body" and not message.get("more_body"):
            finished.set()

    try:
        await asyncio.wait_for(app(_scope(path, body), receive, send), 120)
    finally:
        finished.set()
    return status, b"".join(chunks)


VICTIM = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}


async def _victim_gap_beside(app, path: str, attack: dict) -> tuple[float, int, dict]:
    """The victim's largest gap between chunks from the attack's sending on, and the attack's answer."""
    times: list[float] = []
    victim = asyncio.create_task(_asgi_post(app, "/v1/completions", VICTIM, times))
    while len(times) < 20:  # streaming steadily
        await asyncio.sleep(0.002)
        assert not victim.done(), "the victim ended before the attack"
    sent = time.monotonic()
    status, body = await _asgi_post(app, path, attack)
    answered = time.monotonic()
    await victim
    assert answered < times[-1], "the attack must be answered while the victim still streams"
    return max(b - a for a, b in zip(times, times[1:]) if b > sent), status, json.loads(body)


async def _calmest_gap_beside(app, path: str, plain: dict, attack: dict) -> tuple[float, float, int, dict]:
    """(baseline, gap, status, answer) of the attempt whose attack gap is least above its own baseline, up to
    GAP_ATTEMPTS of them, stopping at the first within MARGIN_S: a stall the attack causes shows in every
    attempt, a pause of the host (a 1.2 s gap seen once in a full run here, in no rerun) in one."""
    attempts = []
    for _ in range(GAP_ATTEMPTS):
        baseline, _, _ = await _victim_gap_beside(app, path, plain)
        gap, status, response = await _victim_gap_beside(app, path, attack)
        attempts.append((baseline, gap, status, response))
        if gap < baseline + MARGIN_S:
            break
    return min(attempts, key=lambda a: a[1] - a[0])


async def _recorded(app, measured):
    """Runs `measured()` inside a recording; returns its result and the engine's longest idle time
    between two steps (a step's start less the previous one's end, from the event stream)."""
    status, body = await _asgi_post(app, "/api/recordings/start", {})
    assert status == 201, body
    result = await measured()
    status, body = await _asgi_post(app, "/api/recordings/stop", {})
    recording = read_recording(server_of(app).recordings.path(json.loads(body)["id"]))
    steps = [e for e in recording.events if isinstance(e, ev.StepFinished)]
    idle = max(b.ts - b.duration_ms / 1e3 - a.ts for a, b in zip(steps, steps[1:]))
    return result, idle


def _run(app, scenario):
    async def main():
        async with AsyncTestClient(app):  # the lifespan: the engine starts and stops
            return await scenario()

    return asyncio.run(main())


@pytest.mark.slow
def test_a_5000_property_schema_does_not_stall_a_streaming_neighbour(tmp_path):
    """The issue's attack: 5,000 optional properties. Its matcher took 0.3-1.5 s to build on the
    engine thread at every request (and its first mask ~110 ms); now the grammar worker builds it
    once with the compilation, and each request copies it."""
    app = tiny_app(tmp_path)
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(5_000)}}
    attack = {
        "messages": [{"role": "user", "content": "Fill it."}],
        "max_tokens": 4,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
    }
    plain = {
        "messages": [{"role": "user", "content": "Fill it."}],
        "max_tokens": 4,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "small", "schema": {"type": "object", "properties": {"f0": {"type": "string"}}}},
        },
    }

    async def scenario():
        for warm in (attack, plain):  # compiled and cached first: what stalled was each request's matcher
            status, body = await _asgi_post(app, "/v1/chat/completions", warm)
            assert status in (200, 400), body[:300]
        return await _calmest_gap_beside(app, "/v1/chat/completions", plain, attack)

    baseline, gap, status, response = _run(app, scenario)
    # answered either way (5,000 optional properties exceed the parser's row limit at the first key: a 400)
    assert status == 200 or response["error"]["param"] == "response_format", response
    assert gap < baseline + MARGIN_S, f"victim's largest gap {gap:.3f} s beside the schema, {baseline:.3f} s without"


@pytest.mark.slow
def test_fifteen_thousand_choices_answer_one_of_them_without_stalling_a_streaming_neighbour(tmp_path):
    """The issue's first attack at the size the constraint bound allows: 100,000 choices stalled every
    stream for ~8.4 s once cached (each request's matcher was built on the engine thread); 15,000 new
    ones now compile on the grammar worker, and each request copies the compiled matcher."""
    app = tiny_app(tmp_path)
    choices = [f"option {i:05d}" for i in range(15_000)]  # ~210,000 characters: under the bound
    attack = {"messages": [{"role": "user", "content": "Pick."}], "max_tokens": 16, "guided_choice": choices}
    plain = {"messages": [{"role": "user", "content": "Pick."}], "max_tokens": 16, "guided_choice": choices[:2]}

    async def scenario():
        for warm in (attack, plain):  # compiled and cached first: what stalled was each request's matcher
            status, body = await _asgi_post(app, "/v1/chat/completions", warm)
            assert status == 200, body[:300]
        (baseline, _, _), idle_before = await _recorded(
            app, lambda: _victim_gap_beside(app, "/v1/chat/completions", plain)
        )
        (gap, status, response), idle = await _recorded(
            app, lambda: _victim_gap_beside(app, "/v1/chat/completions", attack)
        )
        return baseline, gap, status, response, idle_before, idle

    baseline, gap, status, response, idle_before, idle = _run(app, scenario)
    assert status == 200 and response["choices"][0]["message"]["content"] in choices, response
    assert gap < baseline + MARGIN_S, f"victim's largest gap {gap:.3f} s beside the choices, {baseline:.3f} s without"
    assert idle < idle_before + MARGIN_S, f"the engine idled {idle:.3f} s between steps, {idle_before:.3f} s without"


@pytest.mark.slow
def test_prompt_logprobs_on_a_long_prompt_do_not_stall_a_streaming_neighbour(tmp_path):
    """A 1,800-token prompt with `prompt_logprobs: 20`: its chunks ran the LM head and the reductions
    over the vocabulary for every row, so one step cost several plain ones. Now each such token
    counts for what it costs in the step's budget (49 plain tokens on random:tiny, whose layers are
    small beside its 49,152-token head)."""
    engine = tiny_engine(max_model_len=2048, num_blocks=256, max_num_batched_tokens=2048)
    app = tiny_app(tmp_path, engine=engine)
    prompt = [(7 * i) % 40_000 + 100 for i in range(1_800)]
    attack = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20}
    plain = {"prompt": [t + 1 for t in prompt], "max_tokens": 1}  # the same prefill, no prefix-cache hit

    async def scenario():
        # once first: the answer's ~38,000 alternatives are decoded to text on the event loop (the server's
        # cache keeps them); what is measured below is the engine's steps
        status, body = await _asgi_post(app, "/v1/completions", attack)
        assert status == 200, body[:300]
        return await _calmest_gap_beside(app, "/v1/completions", plain, attack)

    baseline, gap, status, response = _run(app, scenario)
    assert status == 200, response
    entries = response["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None and all(len(e) >= 20 for e in entries[1:])
    assert gap < baseline + MARGIN_S, (
        f"victim's largest gap {gap:.3f} s beside prompt_logprobs, {baseline:.3f} s without"
    )


# ---- issue 48: the prompt bound covers the template's every input, logit_bias keys, config fields -------


def test_the_prompt_bound_covers_tools_and_template_variables_before_tokenizing(client, monkeypatch):
    """random:tiny's context is 512 tokens: at most 512 x 64 characters reach its template. Three tools
    of 20,000-character descriptions are refused as `tools` without a tokenizer call (the issue's
    1.08M-character ones held the tokenizer's worker 5.5 s before the 400)."""
    ae = server_of(client.app).async_engine
    calls = []
    real = ae.tokenize
    monkeypatch.setattr(ae, "tokenize", lambda fn: calls.append(fn) or real(fn))
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 20_000}} for i in range(3)]
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
        assert_error(client.post(path, json=body), "tools", "characters")
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"note": "y" * 40_000}}
        assert_error(client.post(path, json=body), "chat_template_kwargs", "characters")
    assert not calls, "refused before anything was tokenized"
    small = [{"type": "function", "function": {"name": "f", "description": "Says hello."}}]
    assert chat(client, tools=small).status_code == 200 and calls  # under the bound: served (and tokenized)


def test_a_logit_bias_key_that_is_not_a_token_id_names_the_field(client):
    for key in ("²", "٣", "abc"):  # str.isdigit took the first two, then int() refused "²" with its own words
        r = chat(client, logit_bias={key: 1})
        assert_error(r, "logit_bias", "logit_bias keys must be token ids", repr(key))
        assert "invalid literal" not in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "update, param, words",
    [
        ({"max_model_len": 1_000_000_000}, "max_model_len", ("max_model_len (read-only",)),
        ({"num_blocks": 64, "colour": "red"}, "colour", ("colour (unknown)", "num_blocks")),
        ({"x" * 100: "y" * 3_000_000}, "x" * 100, ("(unknown)",)),
    ],
)
def test_put_config_refuses_fields_it_cannot_change_by_name(client, update, param, words):
    before = client.get("/api/config").json()
    assert_error(client.put("/api/config", json=update), param, "PUT /api/config cannot change", *words)
    assert client.get("/api/config").json() == before  # nothing applied, not even the settable part
