"""The Metrics panel's memory split, live: every part the server measures is shown with its size, the
KV cache part grows once a request writes blocks, and the weights match /metrics."""

from __future__ import annotations

import re

import httpx
from playwright.sync_api import Page, expect

from e2e_support import shot

PARTS = ("weights", "kv_cache", "compiled", "torch", "libraries", "other")
MIB = 2**20


def _metrics_mib(api: httpx.Client, part: str) -> float:
    text = api.get("/metrics").text
    match = re.search(rf'^minivllm:memory_bytes\{{model_name="[^"]*",part="{part}"\}} (\S+)$', text, re.M)
    assert match, f"/metrics has no memory_bytes for {part}"
    return float(match.group(1)) / MIB


def test_memory_split_is_shown_live(page: Page, api: httpx.Client) -> None:
    r = api.post("/v1/completions", json={"prompt": "Explain what a KV cache is. " * 6, "max_tokens": 16})
    assert r.status_code == 200, r.text
    section = page.get_by_test_id("metrics-memory")
    section.scroll_into_view_if_needed()
    expect(section).to_contain_text("Server memory:")
    for part in PARTS:
        expect(section.get_by_test_id(f"memory-part-{part}")).to_be_visible()
    # the split is re-measured every 5 s: wait for one taken after the request wrote its blocks
    kv = section.get_by_test_id("memory-part-kv_cache").get_by_test_id("memory-bytes")
    expect(kv).not_to_have_text(re.compile(r"^0 B$"), timeout=30_000)
    weights = section.get_by_test_id("memory-part-weights").get_by_test_id("memory-bytes")
    expect(weights).to_have_text(re.compile(r"MiB$"))
    shown = float((weights.text_content() or "").removesuffix(" MiB"))
    assert abs(shown - _metrics_mib(api, "weights")) < 2, (shown, _metrics_mib(api, "weights"))
    shot(page.get_by_test_id("metrics-memory"), "panel-metrics-memory.png")
