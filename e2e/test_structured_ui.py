"""Structured outputs in the chat playground, against the shared server (embedded model).

A JSON schema constrains a reply that must parse with the schema's keys, and its tokens carry the
grammar's mask (`data-allowed`, shaded, with a legend); an invalid schema is caught in the editor and
holds Send back; a list of choices makes the reply exactly one of them; a regex the server cannot
compile comes back as the server's 400 message on the reply.
"""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import Page, expect

from e2e_support import CHAT_PATH, last_reply, reply_text, send_chat, set_decoding, set_structured, set_token_view, shot

# additionalProperties false, as OpenAI's strict mode asks: without it the grammar lets the small model
# add keys until max_tokens runs out.
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def _is_chat_request(request) -> bool:
    return request.url.endswith(CHAT_PATH) and request.method == "POST"


def test_json_schema_reply_parses_and_tokens_show_the_grammar_mask(page: Page) -> None:
    set_decoding(page, preset="greedy", max_tokens=64)
    set_structured(page, "json_schema", json.dumps(SCHEMA))
    expect(page.get_by_test_id("structured-error")).to_have_count(0)
    with page.expect_request(_is_chat_request) as req:
        send_chat(page, "Give the city and population of Paris as JSON.")
    body = req.value.post_data_json
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": SCHEMA, "strict": True},
    }, body
    reply_text(page)
    msg = last_reply(page)
    assert msg.get_attribute("data-finish") == "stop", f"finish reason {msg.get_attribute('data-finish')!r}"

    # every token was chosen under the grammar: each carries the share of the vocabulary it allowed
    # (once the live engine's TokenGenerated events for the request are in), shaded, with a legend
    tokens = msg.get_by_test_id("token")
    expect(tokens.first).to_be_visible()
    expect(msg.locator('[data-testid="token"]:not([data-allowed])')).to_have_count(0)
    fractions = [
        float(x)
        for x in msg.locator('[data-testid="token"][data-allowed]').evaluate_all(
            "els => els.map((e) => e.dataset.allowed)"
        )
    ]
    assert fractions and len(fractions) == tokens.count(), fractions
    assert all(0 < f <= 1 for f in fractions), fractions
    assert min(fractions) < 0.01, f"a JSON schema leaves few choices at its braces and keys: {fractions}"
    expect(msg.get_by_test_id("legend-mask")).to_be_visible()
    narrow = msg.locator('[data-testid="token"][data-allowed]').nth(fractions.index(min(fractions)))
    narrow.hover()
    expect(page.get_by_test_id("token-tooltip").get_by_test_id("token-mask")).to_contain_text("grammar allowed ")
    shot(page.get_by_test_id("chat-panel"), "panel-chat-structured.png")

    # the reply itself (the token view off shows the plain text) is JSON with the schema's keys
    set_token_view(page, False)
    text = msg.get_by_test_id("message-content").text_content() or ""
    data = json.loads(text)
    assert isinstance(data, dict) and {"city", "population"} <= data.keys(), data
    assert isinstance(data["city"], str) and data["city"], data
    assert isinstance(data["population"], int) and not isinstance(data["population"], bool), data
    set_token_view(page, True)


def test_invalid_schema_shows_the_error_and_disables_send(page: Page) -> None:
    set_structured(page, "json_schema", '{"type": "object", "properties": {')
    page.get_by_test_id("chat-input").fill("Tell me about Paris.")
    error = page.get_by_test_id("structured-error")
    send = page.get_by_test_id("chat-send")
    expect(error).to_contain_text("not valid JSON")
    expect(page.get_by_test_id("structured-schema")).to_have_attribute("aria-invalid", "true")
    expect(send).to_be_disabled()
    expect(page.get_by_test_id("chat-problem")).to_contain_text("Structured output")
    # Enter does not send either
    page.get_by_test_id("chat-input").press("Enter")
    expect(page.get_by_test_id("message-assistant")).to_have_count(0)

    # valid JSON that is not an object is refused too
    page.get_by_test_id("structured-schema").fill('["city", "population"]')
    expect(error).to_have_text("a JSON schema must be an object, got an array")
    expect(send).to_be_disabled()

    page.get_by_test_id("structured-schema").fill(json.dumps(SCHEMA))
    expect(error).to_have_count(0)
    expect(page.get_by_test_id("chat-problem")).to_have_count(0)
    expect(send).to_be_enabled()


def test_choices_reply_is_exactly_one_of_them(page: Page) -> None:
    set_decoding(page, preset="greedy", max_tokens=16)
    set_structured(page, "choice", "yes\nno")
    expect(page.get_by_test_id("structured-error")).to_have_count(0)
    with page.expect_request(_is_chat_request) as req:
        send_chat(page, "Is the sky blue on a clear day? Answer yes or no.")
    assert req.value.post_data_json["structured_outputs"] == {"choice": ["yes", "no"]}, req.value.post_data_json
    text = reply_text(page)
    assert text in ("yes", "no"), f"the reply is not one of the choices: {text!r}"
    expect(last_reply(page)).to_have_attribute("data-finish", "stop")


@pytest.mark.console_errors_expected  # the browser logs the refused request's 400
def test_regex_the_server_refuses_shows_its_400_message(page: Page) -> None:
    set_decoding(page, preset="greedy", max_tokens=8)
    set_structured(page, "regex", "([a-z]+")
    expect(page.get_by_test_id("structured-error")).to_have_count(0)  # the client does not judge regex syntax
    page.get_by_test_id("chat-input").fill("Say something.")
    with page.expect_response(lambda r: r.url.endswith(CHAT_PATH) and r.request.method == "POST") as info:
        page.get_by_test_id("chat-send").click()
    assert info.value.status == 400, info.value.status
    message = info.value.json()["error"]["message"]
    msg = last_reply(page)
    expect(msg).to_have_attribute("data-status", "error")
    expect(msg.get_by_test_id("message-error")).to_contain_text(message)
