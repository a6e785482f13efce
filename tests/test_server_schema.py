"""The committed shared/events.schema.json must be what `minivllm schema` generates now."""

from __future__ import annotations

import json

from minivllm.schema import REPO_SCHEMA_PATH, schema_text


def test_committed_schema_is_up_to_date():
    assert REPO_SCHEMA_PATH.is_file(), "run `minivllm schema` (make schema) and commit shared/events.schema.json"
    assert REPO_SCHEMA_PATH.read_text() == schema_text(), (
        "shared/events.schema.json is stale: run `minivllm schema` (make schema) and commit the result"
    )


def test_schema_covers_the_dashboard_api_types():
    defs = json.loads(schema_text())["$defs"]
    for name in (
        "Snapshot",
        "EventBatch",
        "Resync",
        "EngineInfo",
        "ConfigUpdate",
        "RecordingInfo",
        "RecordingStatus",
        "RequestTimings",
        "HealthStatus",
        "ErrorBody",
    ):
        assert name in defs, name
