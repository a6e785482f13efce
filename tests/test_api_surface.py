"""The request surface, generated from docs/API.md's field tables: every field that vLLM's chat and
completion requests define is listed there, and every listed field is sent through the official
`openai` client (`extra_body`) and gets its row's treatment: a 400 that says why (never
"Unrecognized"), a 200 for a no-op, and for an honoured field a response that shows its effect."""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from litestar.testing import TestClient
from test_server_support import sse_events, tiny_app

from minivllm.server import openai_protocol as p

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "API.md"
TREATMENTS = ("honoured", "no-op", "400")

# The field names of vLLM's ChatCompletionRequest and CompletionRequest (vllm/entrypoints/openai),
# OpenAI's own fields included: the surface a client written for vLLM may send.
VLLM_CHAT_FIELDS = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens
n presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice reasoning_effort
include_reasoning parallel_tool_calls user best_of use_beam_search top_k min_p repetition_penalty length_penalty
stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
truncate_prompt_tokens prompt_logprobs allowed_token_ids bad_words echo add_generation_prompt continue_final_message
add_special_tokens documents chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs
structured_outputs guided_json guided_regex guided_choice guided_grammar structural_tag guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids return_token_ids
cache_salt kv_transfer_params vllm_xargs repetition_detection""".split()
VLLM_COMPLETION_FIELDS = """model prompt prompt_embeds best_of echo frequency_penalty logit_bias logprobs max_tokens n
presence_penalty seed stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p
repetition_penalty length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens allowed_token_ids prompt_logprobs add_special_tokens
response_format structured_outputs guided_json guided_regex guided_choice guided_grammar guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids return_token_ids cache_salt
kv_transfer_params vllm_xargs repetition_detection""".split()


def doc_table(route: str) -> dict[str, str]:
    """field -> treatment, from the table under `## <route>` in docs/API.md."""
    section = API_DOC.read_text().split(f"## {route}\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1] in TREATMENTS:
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                assert name not in table, f"{route}: {name} is listed twice"
                table[name] = cells[1]
    return table


# ---- a server and the official client on it ---------------------------------------------------

SALT_PROMPT = "The cache salt test prompt, long enough to fill a couple of KV blocks of sixteen tokens each."
TEMPLATE = (
    "{% if greeting %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% for d in documents or [] %}DOC {{ d.title }}: {{ d.text }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    with TestClient(tiny_app(tmp_path_factory.mktemp("app"), trust_request_chat_template=True)) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)


class Call:
    """One request through the client: the body it answered (or its error), SSE chunks when streamed."""

    def __init__(self, client: openai.OpenAI, route: str, fields: dict[str, Any]):
        base = (
            {"messages": [{"role": "user", "content": "Tell me about KV caches."}]}
            if route == "chat"
            else {"prompt": "Once upon a time"}
        )
        body = {**base, "model": "random:tiny", "max_tokens": 6, "temperature": 0, **fields}
        create = (client.chat.completions if route == "chat" else client.completions).with_raw_response.create
        self.status, self.body, self.chunks = 200, None, None
        try:
            raw = create(
                **{k: body.pop(k) for k in ("model", "stream") if k in body},
                extra_body=body,
                **({} if route == "chat" else {"prompt": body.pop("prompt")}),
                **({"messages": body.pop("messages")} if route == "chat" else {}),
            )
        except openai.APIStatusError as exc:
            self.status, self.body = exc.status_code, exc.response.json()
            return
        text = raw.http_response.read().decode()
        if fields.get("stream"):
            self.chunks = [c for c in sse_events(text) if c != "[DONE]"]
        else:
            self.body = json.loads(text)

    @property
    def choice(self) -> dict:
        assert self.body is not None, self.chunks
        return self.body["choices"][0]

    @property
    def text(self) -> str:
        c = self.choice
        return c["message"]["content"] if "message" in c else c["text"]


def streamed_text(call: Call) -> str:
    return "".join(
        (c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
        for c in call.chunks or []
        if c["choices"]
    )


# ---- the cases: a value per field, and what the response must show --------------------------

Check = Callable[[Call, Call, openai.OpenAI], None]  # (this call, the same request without the field, client)


def same_as_baseline(call: Call, base: Call, _client) -> None:
    assert call.text == base.text


def shows(predicate: Callable[[Call, Call], bool]) -> Check:
    def check(call: Call, base: Call, _client) -> None:
        assert predicate(call, base), (call.body, base.body)

    return check


def _allowed(call: Call, base: Call) -> bool:
    return set(call.choice["token_ids"]) <= {11, 12, 13} and call.choice["token_ids"] != base.choice.get("token_ids")


def _hello_ids() -> list[int]:
    return [i for text in ("hello", " hello") for i in _tokenizer().encode(text, add_special_tokens=False)]


def _bad_words(call: Call, _base: Call, client) -> None:
    """The word's tokens, all but forced by logit_bias, are never drawn once it is a bad word."""
    route = "chat" if "message" in call.choice else "completions"
    forced = Call(client, route, {"logit_bias": {str(i): 100 for i in _hello_ids()}, "return_token_ids": True})
    assert set(forced.choice["token_ids"]) <= set(_hello_ids())
    assert len(call.choice["token_ids"]) == 6 and not set(_hello_ids()) & set(call.choice["token_ids"])


def _score(choice: dict) -> float:
    """A sample's cumulative log-probability, from either route's logprobs."""
    lp = choice["logprobs"]
    return sum(t["logprob"] for t in lp["content"]) if "content" in lp else sum(lp["token_logprobs"])


def _best_of(call: Call, _base: Call, client) -> None:
    """best_of 4 returns the likeliest of the 4 samples that n=4 with the same seed draws."""
    route = "chat" if "message" in call.choice else "completions"
    logprobs = {"logprobs": True} if route == "chat" else {"logprobs": 0}
    drawn = Call(client, route, {"n": 4, "temperature": 1.0, "seed": 2, **logprobs})
    best = max(drawn.body["choices"], key=_score)
    again = Call(client, route, {"best_of": 4, "temperature": 1.0, "seed": 2, **logprobs})
    assert len(call.body["choices"]) == 1 and Call.text.fget(again) == (  # type: ignore[attr-defined]
        best["message"]["content"] if route == "chat" else best["text"]
    )


def _salted(call: Call, _base: Call, client) -> None:
    """A new long prompt twice: a hit under the same salt, none under another."""
    prompt = f"{uuid.uuid4().hex} {SALT_PROMPT}"

    def cached(salt: str) -> int:
        again = Call(client, "completions", {"prompt": prompt, "cache_salt": salt, "max_tokens": 1})
        return again.body["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("tenant-a")
    assert cached("tenant-a") > 0 and cached("tenant-b") == 0 and cached("tenant-a") > 0


def _continuous(call: Call, _base: Call) -> bool:
    counts = [c["usage"]["completion_tokens"] for c in call.chunks]
    return counts == sorted(counts) and counts[-1] == 6


def _token_ids_streamed(call: Call, base: Call) -> bool:
    ids = [t for c in call.chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    first = call.chunks[0]
    prompt_ids = first.get("prompt_token_ids") or first["choices"][0].get("prompt_token_ids")
    return len(ids) == 6 and bool(prompt_ids)


def _penalised(call: Call, base: Call) -> bool:
    """A penalty on repeated tokens changes an output that repeats one (greedy, the same prompt)."""
    ids = base.choice["token_ids"]
    return len(set(ids)) == len(ids) or call.choice["token_ids"] != ids


def _greedy_again(call: Call, base: Call) -> bool:
    """Sampling hot (temperature 1.5, seeded) but cut down to the likeliest token: greedy's output."""
    return call.text == base.text


def _seeded(call: Call, _base: Call, client) -> None:
    route = "chat" if "message" in call.choice else "completions"
    again = Call(client, route, {"temperature": 1.5, "seed": 7})
    other = Call(client, route, {"temperature": 1.5, "seed": 8})
    assert call.text == again.text != other.text


def _prompt_tokens(extra: dict[str, Any], relation: Callable[[int, int], bool]) -> Check:
    """The prompt's token count against that of the same request with `extra` instead of the field."""

    def check(call: Call, _base: Call, client) -> None:
        route = "chat" if "message" in call.choice else "completions"
        other = Call(client, route, _with_template(extra))
        assert relation(call.body["usage"]["prompt_tokens"], other.body["usage"]["prompt_tokens"]), (
            call.body,
            other.body,
        )

    return check


def _backend_checked(call: Call, base: Call, client) -> None:
    assert call.text == base.text
    refused = Call(client, "completions", {"guided_regex": "a", "guided_decoding_backend": "outlines"})
    assert refused.status == 400 and refused.body["error"]["param"] == "guided_decoding_backend"


def _special_tokens(sign: int) -> Check:
    """The prompt grows (+1) or shrinks (-1) by the tokens the tokenizer itself adds (its BOS; the
    embedded tokenizer adds none, and then the count must not change)."""

    def check(call: Call, base: Call, client) -> None:
        tok = client._client.app.state.server.async_engine.engine.tokenizer
        added = len(tok("x", add_special_tokens=True)["input_ids"]) - len(
            tok("x", add_special_tokens=False)["input_ids"]
        )
        assert call.body["usage"]["prompt_tokens"] == base.body["usage"]["prompt_tokens"] + sign * added

    return check


HOT = {"temperature": 1.5, "seed": 3}
PREFILL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
GREETING = {"chat_template": None, "chat_template_kwargs": {"greeting": "hello there my good friend"}}

# Per route, per field: (value, check, partner fields sent along). A check of None: the row's treatment
# alone (400 / 200), for fields whose effect needs more than one request and has its own test:
# length_penalty (test_beam_search.py), priority (test_scheduler / test_engine), parallel_tool_calls
# (test_server_structured.py).
Case = tuple[Any, "Check | None", dict[str, Any]]
COMMON: dict[str, Case] = {
    "model": ("random:tiny", shows(lambda c, b: c.body["model"] == "random:tiny"), {}),
    "max_tokens": (3, shows(lambda c, b: c.body["usage"]["completion_tokens"] == 3), {}),
    "temperature": (1.5, shows(lambda c, b: c.text != b.text), {"seed": 3}),
    "top_p": (1e-9, shows(_greedy_again), HOT),
    "seed": (7, _seeded, {"temperature": 1.5}),
    "n": (2, shows(lambda c, b: len(c.body["choices"]) == 2), {}),
    "stop": (None, shows(lambda c, b: len(c.text) < len(b.text) and b.text.startswith(c.text)), {}),
    "presence_penalty": (2.0, shows(_penalised), {"return_token_ids": True, "max_tokens": 12}),
    "frequency_penalty": (2.0, shows(_penalised), {"return_token_ids": True, "max_tokens": 12}),
    "repetition_penalty": (3.0, shows(_penalised), {"return_token_ids": True, "max_tokens": 12}),
    "logit_bias": ({"11": 100}, shows(lambda c, b: c.choice["token_ids"][0] == 11), {"return_token_ids": True}),
    "stream": (True, shows(lambda c, b: streamed_text(c) == b.text), {}),
    "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, shows(_continuous), {"stream": True}),
    "user": ("someone", same_as_baseline, {}),
    "top_k": (1, shows(_greedy_again), HOT),
    "min_p": (1.0, shows(_greedy_again), HOT),
    "min_tokens": (6, shows(lambda c, b: c.body["usage"]["completion_tokens"] == 6), {}),
    "ignore_eos": (True, shows(lambda c, b: c.choice["finish_reason"] == "length"), {}),
    "stop_token_ids": (
        None,
        shows(
            lambda c, b: (
                c.body["usage"]["completion_tokens"] <= 3 and c.choice["stop_reason"] == b.choice["token_ids"][2]
            )
        ),
        {},
    ),
    "use_beam_search": (
        True,
        shows(lambda c, b: len({x.get("text") or x["message"]["content"] for x in c.body["choices"]}) == 2),
        {"n": 2},
    ),
    "length_penalty": (0.5, None, {"use_beam_search": True}),
    "priority": (-1, None, {}),
    "include_stop_str_in_output": (
        True,
        shows(
            lambda c, b: (
                b.text.startswith(c.text) and c.text.endswith(c.choice["stop_reason"]) and len(c.text) < len(b.text)
            )
        ),
        {},
    ),
    "skip_special_tokens": (False, shows(lambda c, b: "<|im_start|>" in c.text), {"logit_bias": {"1": 100}}),
    "best_of": (4, _best_of, {"temperature": 1.0, "seed": 2}),
    "spaces_between_special_tokens": (False, same_as_baseline, {}),
    "truncate_prompt_tokens": (2, shows(lambda c, b: c.body["usage"]["prompt_tokens"] == 2), {}),
    "prompt_logprobs": (
        1,
        shows(lambda c, b: bool(c.body.get("prompt_logprobs") or c.choice.get("prompt_logprobs"))),
        {},
    ),
    "allowed_token_ids": ([11, 12, 13], shows(_allowed), {"return_token_ids": True}),
    "bad_words": (None, _bad_words, {"return_token_ids": True}),
    "response_format": ({"type": "json_object"}, shows(lambda c, b: c.text.lstrip().startswith("{")), {}),
    "structured_outputs": ({"choice": ["yes", "no"]}, shows(lambda c, b: c.text in ("yes", "no")), {}),
    "guided_json": ({"type": "object"}, shows(lambda c, b: c.text.lstrip().startswith("{")), {}),
    "guided_regex": ("[ab]{3}", shows(lambda c, b: re.fullmatch("[ab]{3}", c.text) is not None), {}),
    "guided_choice": (["left", "right"], shows(lambda c, b: c.text in ("left", "right")), {}),
    "guided_grammar": ('start: "x" "y"', shows(lambda c, b: c.text == "xy"), {}),
    "guided_whitespace_pattern": (" ", shows(lambda c, b: c.text.startswith("{")), {"guided_json": {"type": "object"}}),
    "guided_decoding_backend": ("llguidance", _backend_checked, {}),
    "request_id": ("my-request-7", shows(lambda c, b: c.body["id"].endswith("my-request-7")), {}),
    "return_token_ids": (True, shows(lambda c, b: len(c.choice["token_ids"]) == 6), {}),
    "return_tokens_as_token_ids": (True, shows(lambda c, b: "token_id:" in json.dumps(c.choice["logprobs"])), {}),
    "cache_salt": ("tenant-a", _salted, {}),
    "logits_processors": (["my.processor"], None, {}),
    "kv_transfer_params": ({"do_remote_decode": True}, None, {}),
    "vllm_xargs": ({"x": 1}, None, {}),
    "repetition_detection": ({"max_pattern_size": 4}, None, {}),
}
CHAT_CASES: dict[str, Case] = {
    **COMMON,
    "return_tokens_as_token_ids": (True, COMMON["return_tokens_as_token_ids"][1], {"logprobs": True}),
    "messages": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        shows(lambda c, b: c.body["usage"]["prompt_tokens"] != b.body["usage"]["prompt_tokens"]),
        {},
    ),
    "max_completion_tokens": (2, shows(lambda c, b: c.body["usage"]["completion_tokens"] == 2), {}),
    "logprobs": (True, shows(lambda c, b: len(c.choice["logprobs"]["content"]) == 6), {}),
    "top_logprobs": (
        3,
        shows(lambda c, b: all(len(t["top_logprobs"]) == 3 for t in c.choice["logprobs"]["content"])),
        {"logprobs": True},
    ),
    "tools": (
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        shows(lambda c, b: c.body["usage"]["prompt_tokens"] > b.body["usage"]["prompt_tokens"]),
        {},
    ),
    "tool_choice": (
        "none",
        shows(lambda c, b: c.body["usage"]["prompt_tokens"] == b.body["usage"]["prompt_tokens"]),
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
    ),
    "parallel_tool_calls": (False, None, {}),
    "metadata": ({"k": "v"}, same_as_baseline, {}),
    "store": (False, same_as_baseline, {}),
    "service_tier": ("auto", same_as_baseline, {}),
    "safety_identifier": ("s", same_as_baseline, {}),
    "prompt_cache_key": ("k", same_as_baseline, {}),
    "reasoning_effort": ("low", same_as_baseline, {}),
    "verbosity": ("low", same_as_baseline, {}),
    "include_reasoning": (False, same_as_baseline, {}),
    "modalities": (["text"], same_as_baseline, {}),
    "audio": ({"voice": "alloy", "format": "mp3"}, None, {}),
    "prediction": ({"type": "content", "content": "x"}, None, {}),
    "web_search_options": ({}, None, {}),
    "functions": ([{"name": "f"}], None, {}),
    "function_call": ("auto", None, {}),
    "echo": (
        True,
        shows(lambda c, b: c.text.startswith("Well,")),
        {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True},
    ),
    "add_generation_prompt": (
        False,
        shows(lambda c, b: c.body["usage"]["prompt_tokens"] < b.body["usage"]["prompt_tokens"]),
        {},
    ),
    "continue_final_message": (
        True,
        _prompt_tokens({"messages": PREFILL, "add_generation_prompt": False}, lambda mine, closed: mine < closed),
        {"messages": PREFILL, "add_generation_prompt": False},
    ),
    "chat_template_kwargs": (
        GREETING["chat_template_kwargs"],
        _prompt_tokens({"chat_template": None}, int.__gt__),
        {"chat_template": None},
    ),
    "add_special_tokens": (True, _special_tokens(+1), {}),
    "documents": (
        [{"title": "T", "text": "a document"}],
        _prompt_tokens({"chat_template": None}, int.__gt__),
        {"chat_template": None},
    ),
    "chat_template": (
        None,
        shows(lambda c, b: c.body["usage"]["prompt_tokens"] != b.body["usage"]["prompt_tokens"]),
        {},
    ),
    "structural_tag": ('{"structures": []}', None, {}),
    "mm_processor_kwargs": ({"num_crops": 4}, None, {}),
    "media_io_kwargs": ({"image": {}}, None, {}),
}
COMPLETION_CASES: dict[str, Case] = {
    **COMMON,
    "return_tokens_as_token_ids": (True, COMMON["return_tokens_as_token_ids"][1], {"logprobs": 1}),
    "prompt": ([1, 2, 3], shows(lambda c, b: c.body["usage"]["prompt_tokens"] == 3), {}),
    "logprobs": (2, shows(lambda c, b: all(len(t) >= 2 for t in c.choice["logprobs"]["top_logprobs"])), {}),
    "echo": (True, shows(lambda c, b: c.text == "Once upon a time" + b.text), {}),
    "suffix": ("the end", None, {}),
    "add_special_tokens": (False, _special_tokens(-1), {}),
    "prompt_embeds": ("AAAA", None, {}),
}
CASES = {"chat": CHAT_CASES, "completions": COMPLETION_CASES}
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _fields(field: str, value: Any, partners: dict[str, Any], base: Call) -> dict[str, Any]:
    """What a row sends: its field, its partners, and the values read off the baseline's output."""
    if field == "stop":
        value = base.text[len(base.text) // 2 : len(base.text) // 2 + 2]
    elif field == "stop_token_ids":
        value = [base.choice["token_ids"][2]]
    elif field == "include_stop_str_in_output":
        partners = {**partners, "stop": _token_text(base, 2)}
    elif field == "bad_words":
        value = ["hello"]
        partners = {**partners, "logit_bias": {str(i): 100 for i in _hello_ids()}}
    elif field == "chat_template":
        value = TEMPLATE
    return {**_with_template(partners), field: value}


def _token_text(base: Call, i: int) -> str:
    """The text the baseline's i-th token added (the baseline asks for its token ids)."""
    return _tokenizer().decode(base.choice["token_ids"][i : i + 1])


@functools.cache
def _tokenizer():
    from minivllm.loader import gguf_loader

    return gguf_loader.load_gguf_tokenizer(gguf_loader.embedded_model_path())


def _with_template(fields: dict[str, Any]) -> dict[str, Any]:
    """`chat_template: None` in a case stands for TEMPLATE (kept short in the tables)."""
    return {k: (TEMPLATE if k == "chat_template" else v) for k, v in fields.items()}


# ---- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route, struct, vllm_fields",
    [("chat", p.ChatCompletionRequest, VLLM_CHAT_FIELDS), ("completions", p.CompletionRequest, VLLM_COMPLETION_FIELDS)],
)
def test_every_vllm_field_is_declared_and_documented(route, struct, vllm_fields):
    declared = {f.name for f in msgspec.structs.fields(struct)}
    table = doc_table(ROUTES[route])
    assert not set(vllm_fields) - declared, "decoded as Unrecognized"
    assert not set(vllm_fields) - set(table), "missing from docs/API.md"
    assert not set(table) - declared, "documented but not declared"
    assert set(table) == set(CASES[route]), "every documented field needs a case here, and every case a row"


def _rows(route: str) -> list[tuple[str, str]]:
    return sorted(doc_table(ROUTES[route]).items())


@pytest.fixture(scope="module")
def baselines(client):
    return {route: Call(client, route, {"return_token_ids": True}) for route in CASES}


@pytest.mark.parametrize("route, field, treatment", [(r, f, t) for r in CASES for f, t in _rows(r)])
def test_each_documented_field_gets_its_treatment(client, baselines, route, field, treatment):
    value, check, partners = CASES[route][field]
    base = baselines[route]
    call = Call(client, route, _fields(field, value, partners, base))
    if treatment == "400":
        assert call.status == 400, call.body
        error = call.body["error"]
        assert error["param"] and field in error["param"] and "Unrecognized" not in error["message"], error
        return
    assert call.status == 200, call.body
    if treatment == "no-op" and check is None:
        check = same_as_baseline
    if check is not None:
        check(call, base, client)


# ---- effects that need more than one look --------------------------------------------------


def test_allowed_token_ids_and_bad_words_constrain_every_token(client):
    call = Call(
        client,
        "completions",
        {"allowed_token_ids": [11, 12, 13], "return_token_ids": True, "temperature": 1.0, "seed": 1, "max_tokens": 12},
    )
    assert len(call.choice["token_ids"]) == 12 and set(call.choice["token_ids"]) <= {11, 12, 13}
    free = Call(client, "completions", {"return_token_ids": True, "max_tokens": 12})
    banned = free.choice["token_ids"][0]
    word = free.text[: len(free.text) - len(free.text.lstrip())] + free.text.split()[0]
    no_word = Call(client, "completions", {"bad_words": [word], "return_token_ids": True, "max_tokens": 12})
    assert banned not in no_word.choice["token_ids"][:1]
    assert word.strip() not in no_word.text.split()


def test_return_token_ids_match_the_text_and_the_stream(client, http):
    whole = Call(client, "chat", {"return_token_ids": True})
    tok = http.app.state.server.async_engine.engine.tokenizer
    assert tok.decode(whole.choice["token_ids"]) == whole.text
    assert len(whole.body["prompt_token_ids"]) == whole.body["usage"]["prompt_tokens"]
    streamed = Call(client, "chat", {"return_token_ids": True, "stream": True})
    assert streamed.chunks[0]["prompt_token_ids"] == whole.body["prompt_token_ids"]
    ids = [t for c in streamed.chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert ids == whole.choice["token_ids"]
    completion = Call(client, "completions", {"return_token_ids": True, "stream": True})
    assert _token_ids_streamed(completion, completion)


def test_return_tokens_as_token_ids_names_tokens_by_id(client):
    call = Call(
        client,
        "chat",
        {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    content = call.choice["logprobs"]["content"]
    assert [t["token"] for t in content] == [f"token_id:{i}" for i in call.choice["token_ids"]]
    assert all(alt["token"].startswith("token_id:") for t in content for alt in t["top_logprobs"])


def test_chat_echo_prepends_the_prefill_streaming_too(client):
    fields = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    plain = Call(client, "chat", {k: v for k, v in fields.items() if k != "echo"})
    echoed = Call(client, "chat", fields)
    assert echoed.text == "Well," + plain.text
    streamed = Call(client, "chat", {**fields, "stream": True})
    assert streamed_text(streamed) == echoed.text


def test_best_of_returns_the_likeliest_samples(client):
    many = Call(client, "completions", {"n": 4, "temperature": 1.0, "seed": 5, "logprobs": 0})
    best = Call(client, "completions", {"n": 2, "best_of": 4, "temperature": 1.0, "seed": 5, "logprobs": 0})

    def score(choice: dict) -> float:
        return sum(choice["logprobs"]["token_logprobs"])

    expected = sorted((score(c) for c in many.body["choices"]), reverse=True)[:2]
    assert [c["index"] for c in best.body["choices"]] == [0, 1]
    assert [score(c) for c in best.body["choices"]] == pytest.approx(expected)
    for fields, why in (({"n": 3, "best_of": 2}, "best_of must be"), ({"best_of": 2, "stream": True}, "stream")):
        error = Call(client, "completions", fields)
        assert (
            error.status == 400 and error.body["error"]["param"] == "best_of" and why in error.body["error"]["message"]
        )


def test_chat_template_needs_a_trusted_server_and_documents_reach_it(client, tmp_path):
    with_docs = Call(client, "chat", {"chat_template": TEMPLATE, "documents": [{"title": "T", "text": "x y z"}]})
    without = Call(client, "chat", {"chat_template": TEMPLATE})
    assert with_docs.body["usage"]["prompt_tokens"] > without.body["usage"]["prompt_tokens"]
    with TestClient(tiny_app(tmp_path)) as untrusted:
        r = untrusted.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "chat_template": TEMPLATE}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"request_id": "a b"}, "request_id"),
    ],
)
def test_bad_values_of_the_new_fields_are_400s_naming_them(client, fields, param):
    call = Call(client, "completions", fields)
    assert call.status == 400 and call.body["error"]["param"] == param, call.body
    assert Call(client, "completions", {}).status == 200  # the server goes on
