"""The hostile half of `make soak ATTACK=1`: requests built to cost the server memory or time.

Each is a request a careless or malicious client could send: constraints that compile to large
grammars, each one new (so caches fill), tool definitions near the prompt-size bound, malformed
fields and bodies. The server may answer any 2xx or 4xx; a 5xx or a dropped connection is an error.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable


def _word(rng: random.Random, n: int = 10) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=n))


def many_choices(rng: random.Random) -> dict:
    """15,000 new choices per request (~210,000 characters, under the 262,144-character constraint bound)."""
    return {"guided_choice": [_word(rng) for _ in range(15_000)], "max_tokens": 8}


def wide_schema(rng: random.Random) -> dict:
    """A JSON schema of 2,000 required properties with new names."""
    props = {_word(rng, 8): {"type": "integer"} for _ in range(2_000)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}, "max_tokens": 8}


def long_regex(rng: random.Random) -> dict:
    """An alternation of 5,000 new literals."""
    return {
        "structured_outputs": {"regex": "(" + "|".join(_word(rng, 12) for _ in range(5_000)) + ")"},
        "max_tokens": 8,
    }


def huge_tools(rng: random.Random) -> dict:
    """Three tools whose descriptions together approach the prompt-size bound."""
    tool = lambda i: {  # noqa: E731 - one tool per index
        "type": "function",
        "function": {"name": f"t{i}", "description": _word(rng, 8) * 15_000, "parameters": {"type": "object"}},
    }
    return {"tools": [tool(i) for i in range(3)], "max_tokens": 8}


def bad_fields(rng: random.Random) -> dict:
    """Fields whose values the server must refuse with a 400, not a 500."""
    return rng.choice(
        [
            {"logit_bias": {"²": 1}},
            {"logit_bias": {str(10**12): 5}},
            {"n": 10**6},
            {"max_tokens": -3},
            {"temperature": "hot"},
            {"stop": ["x"] * 10_000},
            {"unknown_field_" + _word(rng): "x" * 100_000},
        ]
    )


def long_prompt(rng: random.Random) -> dict:
    return {"messages": [{"role": "user", "content": " ".join(_word(rng, 6) for _ in range(6_000))}], "max_tokens": 4}


ATTACKS: dict[str, Callable[[random.Random], dict]] = {
    "many choices": many_choices,
    "wide schema": wide_schema,
    "long regex": long_regex,
    "huge tools": huge_tools,
    "bad fields": bad_fields,
    "long prompt": long_prompt,
}


def attack_body(rng: random.Random) -> tuple[str, dict]:
    """(attack name, chat-completion body) for one hostile request."""
    name = rng.choice(list(ATTACKS))
    body = {"messages": [{"role": "user", "content": "Pick one."}], **ATTACKS[name](rng)}
    return name, body


MALFORMED_BODIES = [b"{", b"[]", b'{"messages": ' + b"[" * 5_000, b"\xff\xfe not json"]
