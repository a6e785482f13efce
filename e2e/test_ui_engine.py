"""The engine views against a real engine: the request timeline, the KV-cache heatmap, preemption
under load (timeline + scheduler), and the engine settings."""

from __future__ import annotations

import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from playwright.sync_api import Page, expect

from e2e_support import (
    api_chat,
    dashboard_shot,
    heatmap,
    send_chat,
    set_decoding,
    shot,
    timeline,
    wait_finished,
    wait_idle,
    wait_js,
    wait_owns_blocks,
)


def test_timeline_request_passes_every_state(page: Page) -> None:
    set_decoding(page, preset="greedy", max_tokens=24)
    rid = send_chat(page, "What is a paged KV cache?")
    row = wait_finished(page, rid)
    assert row.segments == ("WAITING", "PREFILL", "DECODE", "FINISHED"), row
    assert row.ticks >= 1, "no prefill chunk tick"
    button = page.get_by_test_id(f"request-row-{rid}")
    expect(button).to_have_attribute("data-state", "FINISHED")
    button.click()
    expect(button).to_have_attribute("aria-pressed", "true")
    expect(page.get_by_test_id("request-detail-id")).to_have_text(rid)
    expect(page.get_by_test_id("request-detail-state")).to_have_text("Finished")
    shot(page.get_by_test_id("timeline-panel"), "panel-timeline.png")
    shot(page.get_by_test_id("request-detail"), "panel-request-detail.png")


def test_heatmap_blocks_follow_the_request(page: Page, engine: dict) -> None:
    # a long answer (200 tokens, over a second at 150 tok/s): the block table is checked while the
    # request still runs (a finished request holds no blocks; 48 tokens had finished before the click
    # on a fast box), so the request is selected first and its chips are polled every frame
    set_decoding(page, preset="greedy", max_tokens=200)
    rid = send_chat(page, "Write a long story about a baker who learns to make bread, in many paragraphs.")
    page.get_by_test_id(f"request-row-{rid}").click()
    expect(page.get_by_test_id("block-table")).to_be_visible()
    # while it runs, the request owns blocks (the heatmap colours them with the request's colour)
    during = wait_owns_blocks(page, rid)
    assert during["used"] >= during["per"][rid] > 0, during
    wait_js(page, "() => document.querySelector('[data-testid=\"block-table\"] .block-chip') !== null")
    shot(page.get_by_test_id("heatmap-panel"), "panel-heatmap-running.png")

    wait_finished(page, rid)
    # after it finishes: nothing is in use, the request owns nothing, its full blocks stay cached
    after = wait_idle(page, rid)
    assert after["blocks"] == engine["num_blocks"], after
    assert after["cached"] >= 2, f"the finished request's full blocks are not cached: {after}"
    assert after["cached"] + after["free"] == after["blocks"], after
    summary = page.get_by_test_id("heatmap-summary")
    expect(summary).to_have_attribute("data-used", "0")
    expect(summary).to_have_attribute("data-cached", str(after["cached"]))
    shot(page.get_by_test_id("heatmap-panel"), "panel-heatmap.png")


SYSTEM = (
    "You are a meticulous assistant for a small bakery. Answer questions about bread, pastry, opening "
    "hours and ingredients. Keep every answer short, friendly and accurate, and never invent prices "
    "or products that the bakery does not sell."
)


def _chat_with_system(server: str, rid: str, question: str, max_tokens: int) -> dict:
    with httpx.Client(base_url=server, timeout=180) as client:
        r = client.post(
            "/v1/chat/completions",
            headers={"X-Request-Id": rid},
            json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
    assert r.status_code == 200, r.text
    return r.json()


def test_shared_system_prompt_shares_and_caches_blocks(page: Page, server: str) -> None:
    a, b = f"sys-a-{uuid.uuid4().hex[:8]}", f"sys-b-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_chat_with_system, server, a, "Do you sell rye bread?", 40)
        # the second request arrives once the first is decoding: its prompt blocks are registered
        wait_js(page, "(id) => window.__e2e.timeline()[id]?.state === 'DECODE'", a)
        second = pool.submit(_chat_with_system, server, b, "When do you open on Sundays?", 24)
        both = wait_js(
            page,
            """([a, b]) => {
          const h = window.__e2e.heatmap();
          return h && h.per[a] > 0 && h.per[b] > 0 && h.shared > 0 ? h : false;
        }""",
            [a, b],
        )
        shot(page.get_by_test_id("heatmap-panel"), "panel-heatmap-shared.png")
        first_body, second_body = first.result(), second.result()
    # the system prompt spans at least two full blocks, held by both requests at once
    assert both["shared"] >= 2, both
    assert both["used"] < both["per"][a] + both["per"][b], both
    cached_tokens = second_body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_tokens >= 2 * 16, second_body["usage"]
    assert first_body["choices"][0]["message"]["content"]
    wait_finished(page, a)
    wait_finished(page, b)
    after = wait_idle(page)
    assert after["shared"] == 0 and after["cached"] >= 2, after


LOAD_PROMPTS = [
    "Explain continuous batching in one paragraph.",
    "Write a haiku about a cache miss.",
    "List three uses of a paged KV cache.",
    "Summarise the plot of Hamlet in two sentences.",
    "Why is the sky blue?",
    "Describe a transformer decoder layer.",
]


def test_load_generator_preempts_and_every_request_is_correct(page: Page, api: httpx.Client, engine: dict) -> None:
    sent: dict[str, dict] = {}  # engine request id -> the body the page sent
    page.on(
        "response",
        lambda r: (
            r.url.endswith("/v1/chat/completions")
            and sent.__setitem__(r.header_value("x-request-id"), r.request.post_data_json)
        ),
    )

    page.get_by_test_id("tab-loadgen").click()
    page.get_by_test_id("loadgen-count").fill(str(len(LOAD_PROMPTS)))
    page.get_by_test_id("loadgen-max-tokens").fill("32")
    page.get_by_test_id("loadgen-temperature").fill("0")
    page.get_by_test_id("loadgen-concurrency").fill(str(len(LOAD_PROMPTS)))
    page.get_by_test_id("loadgen-n").fill("1")
    page.get_by_test_id("loadgen-prompts").fill("\n".join(LOAD_PROMPTS))
    expect(page.get_by_test_id("loadgen-start")).to_have_text(f"Start {len(LOAD_PROMPTS)} requests")
    page.get_by_test_id("loadgen-start").click()

    # While it runs, the pool is too small for all of them: the scheduler preempts.
    wait_js(
        page,
        "() => Object.values(window.__e2e.timeline()).some((r) => r.segments.includes('PREEMPTED'))",
        timeout_ms=120_000,
    )
    alert_rows = page.locator('[data-testid="scheduler-step-row"].row-alert')
    expect(alert_rows.first).to_be_attached(timeout=60_000)
    # freeze the scheduler table on the preemption to read it (and picture it)
    page.get_by_test_id("scheduler-pause").click()
    expect(page.get_by_test_id("scheduler-pause")).to_have_attribute("aria-pressed", "true")
    preempting = alert_rows.first
    preempted_ids = preempting.get_by_test_id("scheduler-preempted-cell").text_content() or ""
    assert preempted_ids.strip(), "a scheduler row is marked as preempting but names no request"
    preempting.scroll_into_view_if_needed()
    shot(page.get_by_test_id("scheduler-panel"), "panel-scheduler.png")
    shot(page.get_by_test_id("heatmap-panel"), "panel-heatmap-load.png")
    page.get_by_test_id("scheduler-pause").click()
    expect(page.get_by_test_id("scheduler-pause")).to_have_attribute("aria-pressed", "false")

    progress = page.get_by_test_id("loadgen-progress")
    expect(progress).to_have_attribute("data-done", str(len(LOAD_PROMPTS)), timeout=180_000)
    expect(progress).to_have_attribute("data-failed", "0")
    expect(progress).to_contain_text("Finished")
    assert len(sent) == len(LOAD_PROMPTS), sent.keys()

    rows = {rid: wait_finished(page, rid) for rid in sent}
    preempted = [rid for rid, row in rows.items() if "PREEMPTED" in row.segments]
    assert preempted, f"no request was preempted: {rows}"
    for rid, row in rows.items():
        assert row.segments[0] == "WAITING" and row.segments[-1] == "FINISHED", (rid, row)
    wait_idle(page)
    shot(page.get_by_test_id("timeline-panel"), "panel-timeline-preemption.png")
    shot(page.get_by_test_id("metrics-panel"), "panel-metrics.png")
    shot(page.get_by_test_id("event-log"), "panel-event-log.png")
    shot(page.get_by_test_id("loadgen-panel"), "panel-loadgen.png")
    expect(page.get_by_test_id("metric-preemptions")).not_to_have_text("0")

    # Every request's text, as the dashboard shows it (the selected request's generated text)...
    shown: dict[str, str] = {}
    for rid in sent:
        page.get_by_test_id(f"request-row-{rid}").click()
        expect(page.get_by_test_id("request-detail-id")).to_have_text(rid)
        expect(page.get_by_test_id("request-detail-state")).to_have_text("Finished")
        shown[rid] = page.get_by_test_id("request-detail").locator(".detail-text .message-text").text_content() or ""
    chosen = page.get_by_test_id(f"request-row-{preempted[0]}")
    if chosen.get_attribute("aria-pressed") != "true":
        chosen.click()
    expect(page.get_by_test_id("request-detail-id")).to_have_text(preempted[0])
    dashboard_shot(page, "dashboard.png")

    # ...equals the same request run alone (greedy, one at a time, through the OpenAI API), up to
    # where the alone run faced a tie at the logits' resolution (see `first_divergence`).
    for rid, body in sent.items():
        assert body["temperature"] == 0 and body["max_tokens"] == 32, body
        assert not {"repetition_penalty", "top_k", "min_p"} & body.keys(), body  # raw logprobs = what greedy ranks
        _, alone = api_chat(api, {**body, "logprobs": True, "top_logprobs": 5})
        assert alone["timings"]["num_preemptions"] == 0
        prompt = body["messages"][-1]["content"]
        problem = first_divergence(shown[rid], alone["choices"][0])
        assert problem is None, f"{rid} ({prompt!r}) differs from the same request run alone: {problem}"


# How close (nats) to the alone run's pick a token must be for a batched run to pick it instead. A
# batch or a preemption's recompute changes fp32 attention sums in their last bits, and the default
# engine rounds activations (to int8 per block of 32 in our kernels; to bf16 in torch's, whose step
# at logits of 8-32 is 0.06-0.125), so a value can cross a rounding boundary: measured, one request in
# six switching between two tokens 0.0625 apart; a flat distribution can hold three such tokens. A scheduling
# bug (a wrong block, position or KV) does not pick the alone run's runner-up at a tie; it shows as a
# difference elsewhere.
NEAR_TIE_NATS = 0.25


def first_divergence(shown: str, alone_choice: dict) -> str | None:
    """None when `shown` (a batched run's text) is the alone run's text, or follows it exactly up to
    a token where the alone run rated another of its top five within NEAR_TIE_NATS, and continues
    with that one."""
    expected = alone_choice["message"]["content"]
    if shown == expected:
        return None
    tokens = alone_choice["logprobs"]["content"]
    assert "".join(t["token"] for t in tokens) == expected, "the logprob tokens do not spell the text"
    offsets = [0]
    for token in tokens:
        if not shown.startswith(token["token"], offsets[-1]):
            break
        offsets.append(offsets[-1] + len(token["token"]))
    else:
        return f"the batched text continues past the alone run's:\n{shown!r}\n{expected!r}"
    # The part can also sit one token earlier: the batched run chose a longer token that starts
    # with the alone run's (" trans" / " transformer").
    for i in (len(offsets) - 1, len(offsets) - 2)[: len(offsets)]:
        token = tokens[i]
        taken = next(
            (
                t
                for t in token["top_logprobs"]
                if t["token"] != token["token"] and shown.startswith(t["token"], offsets[i])
            ),
            None,
        )
        if taken is not None and token["logprob"] - taken["logprob"] <= NEAR_TIE_NATS:
            print(
                f"[e2e] batched and alone runs part at a near-tie, token {i}: {token['token']!r} "
                f"{token['logprob']:.4f} vs {taken['token']!r} {taken['logprob']:.4f}"
            )
            return None
    token = tokens[len(offsets) - 1]
    return (
        f"at token {len(offsets) - 1} the alone run chose {token['token']!r} ({token['logprob']:.4f}; top five "
        f"{[(t['token'], round(t['logprob'], 4)) for t in token['top_logprobs']]}), and the batched run "
        f"did not take a near-tie runner-up:\n{shown!r}\n{expected!r}"
    )


def _choice(*tokens: tuple[str, float, list[tuple[str, float]]]) -> dict:
    content = [
        {"token": t, "logprob": lp, "top_logprobs": [{"token": a, "logprob": b} for a, b in top]}
        for t, lp, top in tokens
    ]
    return {"message": {"content": "".join(t for t, _, _ in tokens)}, "logprobs": {"content": content}}


def test_first_divergence_accepts_only_a_near_tie_runner_up() -> None:
    alone = _choice(
        ("A", -0.1, [("A", -0.1), ("B", -3.0)]),
        (" cat", -1.80, [(" cat", -1.80), (" dog", -1.86)]),
        (" sat", -0.2, [(" sat", -0.2), (" ran", -2.0)]),
    )
    assert first_divergence("A cat sat", alone) is None
    assert first_divergence("A dog barked", alone) is None  # the runner-up of a 0.06-nat tie
    assert "token 0" in first_divergence("B cat sat", alone)  # a runner-up 2.9 nats behind
    assert "token 2" in first_divergence("A cat ran", alone)
    assert "token 1" in first_divergence("A cow sat", alone)  # not among the alone run's candidates
    assert "continues past" in first_divergence("A cat sat down", alone)


def _expect_weights_shown(page: Page, info: dict) -> None:
    """The header and the Engine tab's read-only Weights section show the precision from /api/config."""
    precision = info["quantization"] if info["quantization"] not in ("", "none") else info["dtype"]
    short = re.sub(r"\s*\(.*\)\s*$", "", precision)
    header = page.get_by_test_id("engine-precision")
    expect(header).to_contain_text(short)
    if info["weight_bytes"] > 0:
        # e.g. "int4 g32 · 95.2 MiB weights (18% of fp32)"
        expect(header).to_have_text(re.compile(rf"^{re.escape(short)} · [\d.]+ [KMG]iB weights \([\d.]+% of fp32\)$"))
        shown = float(re.search(r"\(([\d.]+)% of fp32", header.text_content() or "").group(1))  # type: ignore[union-attr]
        assert abs(shown - 100 * info["weight_bytes"] / info["weight_fp32_bytes"]) <= 1, (shown, info)
        expect(page.get_by_test_id("settings-weight-memory")).to_contain_text(f"{shown:g}% of the ")
    else:
        expect(header).to_have_text(short)
    expect(page.get_by_test_id("settings-precision")).to_have_text(precision)
    expect(page.get_by_test_id("settings-weights")).to_contain_text("fixed at load")
    expect(page.get_by_test_id("settings-kernel")).to_have_text(info["kernels"])
    # the e2e server runs the default: the native decode step on its 4-bit weights (model/native_step.py)
    # for every decode step, so no compiled step (model/compiled.py) is built
    assert info["compilation"] == "native decode step (every layer in one C++ call, our kernels)", info["compilation"]
    expect(page.get_by_test_id("settings-compilation")).to_have_text(info["compilation"])


def test_settings_shrink_the_kv_pool(page: Page, api: httpx.Client, engine: dict) -> None:
    smaller = engine["num_blocks"] - 4
    info = api.get("/api/config").json()
    assert info["quantization"] and info["weight_bytes"] >= 0 and isinstance(info["kernels"], list), info
    page.get_by_test_id("tab-settings").click()
    _expect_weights_shown(page, info)
    shot(page.locator("#tabpanel-settings"), "panel-engine-tab.png")
    shot(page.locator("header.topbar"), "header.png")
    field = page.get_by_test_id("settings-num-blocks")
    expect(field).to_have_value(str(engine["num_blocks"]))
    field.fill(str(smaller))
    page.get_by_test_id("settings-apply").click()
    expect(page.get_by_test_id("settings-status")).to_contain_text(f"Applied: {smaller} blocks")
    assert api.get("/api/config").json()["num_blocks"] == smaller
    summary = page.get_by_test_id("heatmap-summary")
    expect(summary).to_contain_text(f"blocks={smaller} used=0")
    expect(summary).to_have_attribute("data-free", str(smaller))
    expect(page.get_by_test_id("engine-model")).to_contain_text(f"{smaller} blocks × {engine['block_size']}")
    expect(page.get_by_test_id("heatmap-panel")).to_contain_text(f"{smaller} blocks × {engine['block_size']} tokens")
    expect(page.get_by_test_id("heatmap-canvas")).to_have_attribute(
        "aria-label", re.compile(rf"^KV cache blocks: 0 in use, 0 shared, 0 cached, {smaller} free\.")
    )
    expect(field).to_have_value(str(smaller))
    # rebuilding the engine keeps the weights as loaded
    after = api.get("/api/config").json()
    fixed = ("quantization", "weight_bytes", "weight_fp32_bytes", "kernels", "compilation")
    assert {k: after[k] for k in fixed} == {k: info[k] for k in fixed}, after
    _expect_weights_shown(page, after)
    shot(page.get_by_test_id("settings-panel"), "panel-settings.png")

    # the smaller pool serves requests
    page.get_by_test_id("tab-chat").click()
    set_decoding(page, preset="greedy", max_tokens=16)
    rid = send_chat(page, "Say hello.")
    during = wait_owns_blocks(page, rid)
    assert during["blocks"] == smaller and during["used"] <= smaller, during
    wait_finished(page, rid)
    assert heatmap(page)["blocks"] == smaller
    assert rid in timeline(page)


def test_settings_switch_the_kv_cache_to_float16(page: Page, api: httpx.Client, engine: dict) -> None:
    """The KV cache dtype select: float16 keeps the (explicit) block count in half the bytes, the
    rebuilt engine (its decode step compiled again for the new pool) serves a chat."""
    page.get_by_test_id("tab-settings").click()
    select = page.get_by_test_id("settings-kv-dtype")
    expect(select).to_have_value("float32")
    select.select_option("float16")
    page.get_by_test_id("settings-apply").click()
    expect(page.get_by_test_id("settings-status")).to_contain_text(
        f"Applied: {engine['num_blocks']} blocks × {engine['block_size']} tokens (float16)", timeout=180_000
    )
    assert api.get("/api/config").json()["kv_cache_dtype"] == "float16"
    expect(select).to_have_value("float16")
    page.get_by_test_id("tab-chat").click()
    set_decoding(page, preset="greedy", max_tokens=16)
    rid = send_chat(page, "Say hello.")
    wait_finished(page, rid)
    assert rid in timeline(page)
