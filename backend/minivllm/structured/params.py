"""What a request constrains its output to (vLLM's `StructuredOutputsParams`): exactly one of a
JSON schema, any JSON object, a regular expression, a choice of strings, or a Lark grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The largest constraint compiled, as JSON text (a schema, a regex, a grammar, the choices): 10,000
# short choices or a 5,000-property schema fit; compiling one near the bound takes ~1-5 s on the grammar
# worker (a 2-core box), never the engine thread
MAX_CONSTRAINT_CHARS = 256 * 1024
# Arrays and objects nested in a schema (a real one nests a few levels): deeper ones would exhaust the
# recursion of everything that walks a schema (Python's json, strict mode's closing, the chat template)
MAX_SCHEMA_DEPTH = 64


def check_schema_depth(value: Any, source: str) -> None:
    """ValueError naming `source` when `value` nests arrays/objects deeper than MAX_SCHEMA_DEPTH;
    iterative, so any depth is measured safely."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(
                    f"{source}: the JSON schema nests arrays and objects more than {MAX_SCHEMA_DEPTH} levels deep"
                )
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's), or GBNF
    # JSON: where whitespace may go. By default none beyond one space after ":" and ",": small models
    # otherwise wander into endless newlines. `any_whitespace` allows any; a pattern allows that.
    any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # an origin for error messages: the request field this came from (response_format, guided_json...)
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):  # parsed once, here: the cache key and the compiler read the object
            object.__setattr__(self, "json", self._parsed(self.json))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the source field: exactly one constraint, each well-formed."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{self.source} must set exactly one of {', '.join(KINDS)}, got {', '.join(given) if given else 'none'}"
            )
        if self.choice is not None:
            if not self.choice:
                raise ValueError(f"{self.source}: the list of choices is empty")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{self.source}: every choice must be a non-empty string")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{self.source}: {name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"{self.source}: a JSON schema must be a JSON object, got {type(self.json).__name__}")
        check_schema_depth(self.json, self.source)
        if len(self.cache_key) > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"{self.source}: the constraint is {len(self.cache_key):,} characters as JSON; this "
                f"server compiles constraints of up to {MAX_CONSTRAINT_CHARS:,}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> Any:
        """The JSON schema as an object (a string one was parsed on construction)."""
        return self.json

    def _parsed(self, text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.source}: the JSON schema is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError(
                f"{self.source}: the JSON schema nests arrays and objects more than {MAX_SCHEMA_DEPTH} levels deep"
            ) from None

    @cached_property
    def cache_key(self) -> str:
        """Equal constraints share one compiled grammar (the server's compile and the engine's ask)."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.any_whitespace, self.whitespace_pattern], sort_keys=True)
