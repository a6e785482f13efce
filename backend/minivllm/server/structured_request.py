"""A request's structured-output constraint from whichever field carries it: OpenAI's
`response_format`, vLLM's `structured_outputs` object, or vLLM's older `guided_*` fields.
At most one may be given; a malformed one is a 400 naming the field it came from."""

from __future__ import annotations

from typing import Any

from minivllm.engine.api import StructuredOutputsParams, check_schema_depth
from minivllm.server import openai_protocol as p
from minivllm.server.errors import bad_request

BACKENDS = ("auto", "guidance", "llguidance")  # the one backend this server has, by vLLM's names for it


def structured_outputs(req: p.SamplingFields) -> StructuredOutputsParams | None:
    _check_backend(req.guided_decoding_backend)
    given = [(name, build) for name, build in _SOURCES if build(req) is not None]
    if len(given) > 1:
        raise bad_request(
            f"set only one structured-output field, got {', '.join(name for name, _ in given)}", given[1][0]
        )
    if not given:
        return None
    name, build = given[0]
    try:
        return build(req)()
    except ValueError as exc:
        raise bad_request(str(exc), name) from None


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not available: this server constrains output "
            f"with llguidance; use one of {', '.join(BACKENDS)} or leave it out",
            "guided_decoding_backend",
        )


def _from_response_format(req: p.SamplingFields):
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return lambda: StructuredOutputsParams(json_object=True, source="response_format")
    if rf.json_schema is None:
        raise bad_request("response_format of type json_schema needs a json_schema object", "response_format")
    schema = rf.json_schema.schema if rf.json_schema.schema is not None else {}  # no schema: any JSON value
    _check_depth(schema, "response_format")
    if rf.json_schema.strict:
        schema = closed_objects(schema)
    return lambda: StructuredOutputsParams(json=schema, source="response_format")


def _check_depth(schema: Any, field: str) -> None:
    try:
        check_schema_depth(schema, field)
    except ValueError as exc:
        raise bad_request(str(exc), field) from None


def closed_objects(schema: Any) -> Any:
    """OpenAI's strict mode: an object schema allows no properties beyond those it lists. OpenAI
    refuses a strict schema without `additionalProperties: false`; this server closes such objects."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {k: (v if k in ("enum", "const", "default", "examples") else closed_objects(v)) for k, v in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _from_structured_outputs(req: p.SamplingFields):
    so = req.structured_outputs
    if so is None:
        return None
    for name in ("structural_tag", "disable_additional_properties"):
        if getattr(so, name) is not None:
            raise bad_request(f"structured_outputs.{name} is not supported by this server", "structured_outputs")
    return lambda: StructuredOutputsParams(
        json=so.json,
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
        json_object=bool(so.json_object),
        any_whitespace=so.disable_any_whitespace is False,
        whitespace_pattern=so.whitespace_pattern,
        source="structured_outputs",
    )


def _guided(field: str, kind: str):
    def build(req: p.SamplingFields):
        value = getattr(req, field)
        if value is None:
            return None
        return lambda: StructuredOutputsParams(
            **{kind: value}, whitespace_pattern=req.guided_whitespace_pattern, source=field
        )

    return build


_SOURCES = (
    ("response_format", _from_response_format),
    ("structured_outputs", _from_structured_outputs),
    ("guided_json", _guided("guided_json", "json")),
    ("guided_regex", _guided("guided_regex", "regex")),
    ("guided_choice", _guided("guided_choice", "choice")),
    ("guided_grammar", _guided("guided_grammar", "grammar")),
)
