"""The Ablation panel: "Run ablation" runs `minivllm bench ablation --quick` on the server (a process per
configuration), shows its progress, and draws one bar per configuration; a second start while one
runs is refused with a 409."""

from __future__ import annotations

import httpx
from playwright.sync_api import Page, expect

from e2e_support import shot

CONFIGURATIONS = 8  # all on, then each optimisation off, then speculation on (bench/ablation.py CONFIGS)
RUN_TIMEOUT_MS = 600_000  # eight model loads and runs; about a minute on an idle 2-core box


def test_run_ablation_draws_a_bar_per_configuration(page: Page, api: httpx.Client) -> None:
    panel = page.get_by_test_id("ablation-panel")
    panel.scroll_into_view_if_needed()
    panel.get_by_test_id("ablation-run").click()
    expect(panel.get_by_test_id("ablation-progress")).to_have_attribute("data-state", "running")
    again = api.post("/api/ablation")
    assert again.status_code == 409, again.text
    expect(panel.get_by_test_id("ablation-progress")).to_have_attribute("data-state", "done", timeout=RUN_TIMEOUT_MS)
    canvas = panel.get_by_test_id("ablation-canvas")
    expect(canvas).to_have_attribute("data-bars", str(CONFIGURATIONS))
    label = canvas.get_attribute("aria-label") or ""
    assert label.startswith("all on 1.00×") and "no KV cache" in label, label
    result = api.get("/api/ablation").json()
    assert result["state"] == "done" and all(r["tokens_per_s"] > 0 for r in result["result"]["rows"])
    shot(panel, "panel-ablation.png")
