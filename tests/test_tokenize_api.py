"""vLLM's /tokenize, /detokenize and /version routes, on the tiny model (the embedded SmolLM2
tokenizer and its chat template)."""

from __future__ import annotations

import importlib.metadata
import threading

import pytest
from litestar.testing import TestClient
from test_server_support import server_of, tiny_app, tiny_engine, wait_for

from minivllm.server.app import create_app
from minivllm.server.config import ServerConfig
from minivllm.text.tokenizer_utils import load_chat_template_prompt

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a joke."}]},
]
CHAT_PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a joke."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with TestClient(tiny_app(tmp_path_factory.mktemp("tok"))) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(client):
    return server_of(client.app).async_engine.tokenizer


def error_of(response, status: int):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_tokenize_a_prompt_is_the_tokenizers_encode(client, tokenizer):
    prompt = "The KV cache holds keys and values. Ünïcödé ✓"
    r = client.post("/tokenize", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {
        "count": len(body["tokens"]),
        "max_model_len": 512,
        "tokens": tokenizer.encode(prompt, add_special_tokens=True),
        "token_strs": None,
    }
    off = client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False, "model": "random:tiny"}).json()
    assert off["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)


def test_return_token_strs(client, tokenizer):
    body = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]) == ["Hello", "Ġworld"]
    chat = client.post("/tokenize", json={"messages": CHAT_PLAIN, "return_token_strs": True}).json()
    assert len(chat["token_strs"]) == chat["count"] and "<|im_start|>" in chat["token_strs"]


def test_chat_form_is_the_chat_templates_ids(client, tokenizer):
    expected = load_chat_template_prompt(tokenizer, CHAT_PLAIN, add_generation_prompt=True)
    body = client.post("/tokenize", json={"messages": CHAT}).json()  # text parts are joined, as for chat
    assert body["tokens"] == expected and body["count"] == len(expected)
    no_prompt = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == load_chat_template_prompt(tokenizer, CHAT_PLAIN, add_generation_prompt=False)
    assert no_prompt["tokens"] != body["tokens"] and body["tokens"][: no_prompt["count"]] == no_prompt["tokens"]


def test_chat_template_options_reach_the_template(client, tokenizer):
    # continuing the final (assistant) message leaves it open: no closing <|im_end|> after it
    turns = CHAT_PLAIN + [{"role": "assistant", "content": "Why did the"}]
    cont = client.post(
        "/tokenize", json={"messages": turns, "add_generation_prompt": False, "continue_final_message": True}
    ).json()
    assert tokenizer.decode(cont["tokens"]).endswith("<|im_start|>assistant\nWhy did the")
    closed = client.post("/tokenize", json={"messages": turns, "add_generation_prompt": False}).json()
    assert closed["tokens"][: cont["count"]] == cont["tokens"] and closed["count"] > cont["count"]
    # extra template variables are accepted (this template uses none: same ids)
    extra = client.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert extra.status_code == 200, extra.text
    assert extra.json()["tokens"] == client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    # tools: this template does not know them, so they come first as a system message, as the chat route sends them
    tools = [{"type": "function", "function": {"name": "joke", "parameters": {"type": "object"}}}]
    offered = tokenizer.decode(client.post("/tokenize", json={"messages": CHAT, "tools": tools}).json()["tokens"])
    assert offered.startswith("<|im_start|>system\n") and "<tools>" in offered and '"name": "joke"' in offered
    assert offered.endswith(
        tokenizer.decode(client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]).split("<|im_end|>\n", 1)[1]
    )
    # add_special_tokens: the rendered text encoded with them (this tokenizer adds none)
    special = client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}).json()
    rendered = tokenizer.apply_chat_template(CHAT_PLAIN, add_generation_prompt=True, tokenize=False)
    assert special["tokens"] == tokenizer.encode(rendered, add_special_tokens=True)
    err = error_of(client.post("/tokenize", json={"messages": CHAT, "continue_final_message": True}), 400)
    assert err["param"] == "continue_final_message"
    err = error_of(client.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"tokenize": False}}), 400)
    assert err["param"] == "chat_template_kwargs" and "tokenize" in err["message"]


def test_detokenize_round_trips(client, tokenizer):
    text = "Paged attention, in blocks of 16. Ünïcödé ✓"
    ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
    r = client.post("/detokenize", json={"tokens": ids, "model": "random:tiny"})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    chat = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": chat}).json()["prompt"] == tokenizer.decode(chat)
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("bad", [49152, -1, 10**12])
def test_out_of_range_tokens_are_a_400(client, bad):
    err = error_of(client.post("/detokenize", json={"tokens": [1, bad]}), 400)
    assert err["param"] == "tokens" and str(bad) in err["message"] and err["type"] == "invalid_request_error"


UNKNOWN = object()  # an unknown field


@pytest.mark.parametrize(
    "route,body,param,words",
    [
        ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, UNKNOWN, "add_generation_prompt"),
        ("/tokenize", {"prompt": "hi", "bogus": 1}, UNKNOWN, "bogus"),
        ("/tokenize", {"messages": CHAT, "prompt_typo": 1}, UNKNOWN, "prompt_typo"),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, UNKNOWN, "colour"),
        ("/detokenize", {"tokens": [1], "text": "x"}, UNKNOWN, "text"),
        ("/tokenize", {"prompt": "hi", "messages": CHAT}, "messages", "not both"),
        ("/tokenize", {"model": "random:tiny"}, "prompt", "`prompt`"),
        ("/tokenize", {"prompt": 7}, "prompt", "Expected `str`"),
        ("/tokenize", {"messages": []}, "messages", "at least one message"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "role"),
        ("/detokenize", {"tokens": "1 2"}, "tokens", "Expected `array`"),
        ("/detokenize", b"[1, 2]", None, "Expected `object`"),
        ("/tokenize", b"", None, "empty"),
        ("/tokenize", b"{nope", None, "malformed JSON"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, route, body, param, words):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    err = error_of(client.post(route, **kwargs), 400)
    assert words in err["message"], err
    if param is UNKNOWN:  # named in the message; the param is the field, by its path when nested
        assert err["param"] is None or err["param"].split(".")[-1] == words or err["param"] == "messages", err
    else:
        assert err["param"] == param, err


def test_prompt_too_long_to_fit_is_refused_before_tokenizing(client):
    err = error_of(client.post("/tokenize", json={"prompt": "x" * (512 * 64 + 1)}), 400)
    assert err["param"] == "prompt" and "512 tokens" in err["message"]
    # longer than the context but able to fit it in characters: counted, as vLLM does
    body = client.post("/tokenize", json={"prompt": "word " * 600}).json()
    assert body["count"] > body["max_model_len"] == 512


def test_wrong_model_is_a_404(client):
    for route, body in (
        ("/tokenize", {"prompt": "hi"}),
        ("/tokenize", {"messages": CHAT}),
        ("/detokenize", {"tokens": [1]}),
    ):
        err = error_of(client.post(route, json={**body, "model": "gpt-4"}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"


def test_version_is_the_package_version(client):
    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("minivllm")}


def test_api_key_guards_tokenize_and_detokenize(tmp_path):
    with TestClient(tiny_app(tmp_path, api_key="sesame")) as c:
        for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert error_of(c.post(route, json=body), 401)["code"] == "invalid_api_key"
            assert c.post(route, json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert c.get("/version").status_code == 200  # like /health: no key needed


def test_503_while_the_model_loads(tmp_path):
    release = threading.Event()

    def slow_load():
        assert release.wait(30)
        return tiny_engine()

    with TestClient(create_app(ServerConfig(engine=slow_load, recordings_dir=tmp_path))) as c:
        assert error_of(c.post("/tokenize", json={"prompt": "hi"}), 503)["code"] == "model_loading"
        assert error_of(c.post("/detokenize", json={"tokens": [1]}), 503)["code"] == "model_loading"
        assert c.get("/version").status_code == 200
        release.set()
        wait_for(lambda: c.get("/health").status_code == 200, what="the model to load")
        assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 200


def test_routes_are_in_the_openapi_document(client):
    paths = client.get("/docs/openapi.json").json()["paths"]
    assert {"/tokenize", "/detokenize", "/version"} <= set(paths)
