"""The chat's conversation features against the real server (embedded model): a successful chat is
read to its end (no aborted request), conversations survive a reload, regenerate keeps versions,
Continue extends a reply through the API, and the conversation follows new replies with the
Decoding settings open."""

from __future__ import annotations

import json
import time

from playwright.sync_api import Page, Request, expect

from e2e_support import CHAT_PATH, last_reply, regenerate, reply_text, send_chat, set_decoding, set_token_view, shot


def _watch_requests(page: Page) -> tuple[list[str], list[str]]:
    """Chat requests that finished and that failed (net::ERR_ABORTED and the like), as they happen."""
    finished: list[str] = []
    failed: list[str] = []

    def done(r: Request) -> None:
        if r.url.endswith(CHAT_PATH):
            finished.append(r.url)

    def fail(r: Request) -> None:
        if r.url.endswith(CHAT_PATH):
            failed.append(f"{r.url}: {r.failure}")

    page.on("requestfinished", done)
    page.on("requestfailed", fail)
    return finished, failed


def _console_errors(page: Page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    return errors


def _wait_settled(page: Page, finished: list[str], failed: list[str], count: int, timeout_s: float = 30) -> None:
    """Waits until `count` chat requests have ended, one way or the other."""
    deadline = time.monotonic() + timeout_s
    while len(finished) + len(failed) < count:
        assert time.monotonic() < deadline, f"{count} chat requests did not end: finished {finished}, failed {failed}"
        page.wait_for_timeout(100)  # polling Playwright's request events


def test_successful_chats_are_not_aborted_and_regenerate_and_continue_work(page: Page) -> None:
    finished, failed = _watch_requests(page)
    errors = _console_errors(page)
    set_decoding(page, preset="greedy", max_tokens=12)
    send_chat(page, "Name a colour.")
    first = reply_text(page)
    assert first.strip(), "empty reply"
    _wait_settled(page, finished, failed, 1)
    assert failed == [], f"a successful chat was aborted by the client: {failed}"

    # Regenerate (balanced, seeded) keeps the first reply as version 1 of 2
    set_decoding(page, preset="balanced", seed=7)
    regenerate(page)
    second = reply_text(page)
    msg = last_reply(page)
    expect(page.get_by_test_id("message-assistant")).to_have_count(1)
    expect(msg.get_by_test_id("message-version")).to_have_text("2/2")
    msg.get_by_test_id("message-version-prev").click()
    expect(msg.get_by_test_id("message-version")).to_have_text("1/2")
    assert reply_text(page) == first
    msg.get_by_test_id("message-version-next").click()
    assert reply_text(page) == second

    # Continue: the last assistant message goes to the server open, and the reply grows from it
    with page.expect_request(lambda r: r.url.endswith(CHAT_PATH) and r.method == "POST") as req:
        msg.get_by_test_id("message-continue").click()
    body = req.value.post_data_json
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False, body
    assert body["messages"][-1]["role"] == "assistant", body["messages"]
    expect(msg).to_have_attribute("data-status", "done", timeout=90_000)
    expect(msg.get_by_test_id("message-error")).to_have_count(0)
    continued = reply_text(page)
    assert continued.startswith(second) and len(continued) > len(second), (second, continued)

    _wait_settled(page, finished, failed, 3)
    assert failed == [], f"successful chats were aborted by the client: {failed}"
    assert len(finished) == 3, finished
    assert errors == [], f"console errors: {errors}"


def test_conversation_and_system_prompt_survive_a_reload(page: Page) -> None:
    errors = _console_errors(page)
    set_decoding(page, preset="greedy", max_tokens=16)
    page.get_by_test_id("system-prompt").locator("summary").click()
    page.get_by_test_id("system-prompt-input").fill("You answer in one short sentence.")
    with page.expect_request(lambda r: r.url.endswith(CHAT_PATH) and r.method == "POST") as req:
        send_chat(page, "What is a lighthouse?")
    assert req.value.post_data_json["messages"][0] == {"role": "system", "content": "You answer in one short sentence."}
    before = reply_text(page)
    set_token_view(page, False)  # Markdown: the reply's text as it reads
    markdown = last_reply(page).get_by_test_id("message-content").text_content()

    page.reload()
    expect(page.get_by_test_id("connection-badge")).to_have_attribute("data-status", "live")
    expect(page.get_by_test_id("message-user")).to_have_count(1)
    expect(page.get_by_test_id("message-user")).to_contain_text("What is a lighthouse?")
    msg = last_reply(page)
    expect(msg).to_have_attribute("data-status", "done")
    # the token view is back on after a reload: the same tokens as before it
    assert msg.get_by_test_id("message-content").text_content() == before
    set_token_view(page, False)
    assert msg.get_by_test_id("message-content").text_content() == markdown
    expect(page.get_by_test_id("system-prompt-input")).to_have_value("You answer in one short sentence.")
    expect(page.get_by_test_id("chat-title")).to_have_text("What is a lighthouse?")

    # a new chat starts empty; the first one is still in the list
    page.get_by_test_id("chat-new").click()
    expect(page.get_by_test_id("message-user")).to_have_count(0)
    page.get_by_test_id("chats-toggle").click()
    expect(page.get_by_test_id("conversation")).to_have_count(2)
    page.get_by_test_id("conversation-open").filter(has_text="What is a lighthouse?").click()
    expect(page.get_by_test_id("message-user")).to_contain_text("What is a lighthouse?")
    shot(page.get_by_test_id("chat-panel"), "panel-chat-conversations.png")
    assert errors == [], f"console errors: {errors}"


def test_import_reports_a_bad_file_and_renders_a_good_one_as_markdown(page: Page) -> None:
    page.get_by_test_id("chats-toggle").click()
    bad = {"format": "minivllm-chats", "version": 1, "conversations": [{"turns": [{"role": "user", "content": 3}]}]}
    page.get_by_test_id("chats-import-file").set_input_files(
        files=[{"name": "bad.json", "mimeType": "application/json", "buffer": json.dumps(bad).encode()}]
    )
    expect(page.get_by_test_id("chats-import-error")).to_have_text(
        "bad.json: conversations[0].turns[0].content: expected a string, got a number"
    )
    expect(page.get_by_test_id("conversation")).to_have_count(1)

    # a good file: its reply renders as Markdown (token view off), and Copy puts a code block's code
    # on the clipboard
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    reply = "Use **ls**:\n\n```sh\nls -l /tmp\n```\n\n| flag | meaning |\n|---|---|\n| -l | long |\n"
    good = {
        "title": "Shell help",
        "turns": [{"role": "user", "content": "How do I list files?"}, {"role": "assistant", "content": reply}],
    }
    page.get_by_test_id("chats-import-file").set_input_files(
        files=[{"name": "good.json", "mimeType": "application/json", "buffer": json.dumps(good).encode()}]
    )
    expect(page.get_by_test_id("chats-import-error")).to_have_count(0)
    expect(page.get_by_test_id("chat-title")).to_have_text("Shell help")
    set_token_view(page, False)
    content = last_reply(page).get_by_test_id("message-content")
    expect(content.locator("strong")).to_have_text("ls")
    expect(content.locator("td").first).to_have_text("-l")
    content.get_by_test_id("copy-code").click()
    expect(content.get_by_test_id("copy-code")).to_have_attribute("data-state", "copied")
    assert page.evaluate("() => navigator.clipboard.readText()") == "ls -l /tmp\n"
    shot(page.get_by_test_id("chat-panel"), "panel-chat-markdown.png")


_AT_END = """() => {
  const el = document.querySelector('[data-testid="chat-messages"]');
  const gap = el.scrollHeight - el.scrollTop - el.clientHeight;
  return { overflow: el.scrollHeight - el.clientHeight, gap, height: el.clientHeight };
}"""


def test_conversation_follows_new_replies_with_the_decoding_settings_open(page: Page) -> None:
    # a tall conversation from a file, so the list overflows without waiting for many replies; its
    # height is in blank lines, which cost the prompt few tokens (the e2e KV pool holds 256)
    turns = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello." + "\n" * 60 + "Bye."}]
    page.get_by_test_id("chats-toggle").click()
    page.get_by_test_id("chats-import-file").set_input_files(
        files=[{"name": "long.json", "mimeType": "application/json", "buffer": json.dumps({"turns": turns}).encode()}]
    )
    expect(page.get_by_test_id("chats-imported")).to_contain_text("Imported 1 conversation")
    page.get_by_test_id("chats-toggle").click()
    set_decoding(page, preset="greedy", max_tokens=48)  # leaves the Decoding settings open
    send_chat(page, "Write a short poem about the sea.")
    reply_text(page)
    page.wait_for_function("() => true", polling="raf")  # one frame for the last layout
    got = page.evaluate(_AT_END)
    assert got["height"] > 100, f"the conversation has no room beside the Decoding settings: {got}"
    assert got["overflow"] > 200, f"the conversation does not overflow, nothing to check: {got}"
    assert got["gap"] <= 48, f"the conversation did not follow the new reply: {got}"


def test_a_tool_call_shows_as_its_card_without_its_markup(page: Page) -> None:
    # the example tools' system message takes ~200 of the 256 tokens the e2e KV pool holds
    set_decoding(page, preset="greedy", max_tokens=48)
    page.get_by_test_id("tools-details").locator("summary").click()
    page.get_by_test_id("tools-example").click()
    page.get_by_test_id("tool-choice").select_option("required")
    send_chat(page, "What is the weather in Paris?")
    reply_text(page)
    msg = last_reply(page)
    expect(msg).to_have_attribute("data-finish", "tool_calls")
    expect(msg.get_by_test_id("tool-call")).to_have_count(1)
    # the model wrote <tool_call>{...}</tool_call>: those tokens became the card, not text
    tokens = msg.get_by_test_id("token").evaluate_all("els => els.map((e) => e.textContent)")
    assert "tool_call" not in "".join(tokens), tokens
    assert "tool_call" not in (msg.get_by_test_id("message-content").text_content() or "")
