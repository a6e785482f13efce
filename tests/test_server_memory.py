"""/metrics exports the RSS split (engine/memory_view.py) as one gauge with a `part` label."""

from __future__ import annotations

import re
import sys

import pytest
from litestar.testing import TestClient
from test_server_support import tiny_app, tiny_engine, wait_for

from minivllm.server.metrics import MEMORY_PARTS

MODEL = 'model_name="random:tiny"'
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the split reads /proc/self")


def gauge(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^minivllm:{name}\{{{labels}\}} (\S+)$", text, re.M)
    assert match, f"no minivllm:{name}{{{labels}}} in /metrics"
    return float(match.group(1))


def _settled(text: str):
    parts = {part: gauge(text, "memory_bytes", f'{MODEL},part="{part}"') for part in MEMORY_PARTS}
    rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))
    return (text, parts, rss) if abs(sum(parts.values()) - rss) < 0.05 * rss else None


def test_metrics_split_the_resident_memory_by_part(tmp_path):
    engine = tiny_engine()
    with TestClient(tiny_app(tmp_path, engine)) as client:
        client.post("/v1/completions", json={"prompt": "Hello there, general Kenobi. " * 8, "max_tokens": 4})
        # the split is re-measured every 5 s, the process's RSS at each scrape: once the RSS settles
        # after the request, a later split sums to it
        text, parts, rss = wait_for(
            lambda: _settled(client.get("/metrics").text), timeout=30, interval=0.25, what="a split"
        )
    assert "# TYPE minivllm:memory_bytes gauge" in text
    assert all(v >= 0 for v in parts.values()) and parts["torch"] > 0 and parts["weights"] > 0
    assert gauge(text, "kv_cache_reserved_bytes", MODEL) == engine.kv_cache.num_bytes
    assert 0 <= parts["kv_cache"] <= engine.kv_cache.num_bytes  # the split may predate the request
