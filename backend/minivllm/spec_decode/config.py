"""`--speculative-config`: vLLM's JSON object, validated once at start-up.

  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
  {"method": "draft_model", "model": "<model spec>", "quantization": "int4", "num_speculative_tokens": 3}
  {"method": "early_exit", "exit_layer": 8, "num_speculative_tokens": 2}

`disable_by_batch_size` (any method): no drafts while this many requests or more run; a batch that
large already keeps the weights busy, so verifying k extra tokens per sequence no longer rides free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from minivllm.errors import ConfigError

METHODS = ("ngram", "draft_model", "early_exit")
PARAM = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: any model spec the loader takes
    quantization: str = "auto"  # draft_model: its weights' precision
    exit_layer: int | None = None  # early_exit: draft from this many of the target's layers
    disable_by_batch_size: int | None = 4
    # mini-vllm's own: give drafts only where measured step costs say they pay (spec_decode/planner.py);
    # false drafts k tokens whenever it can, as vLLM does
    adaptive: bool = True

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A JSON string, a dict or a config; None or "" means no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value.validate() if value is not None else None
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative config is not valid JSON: {exc}", PARAM) from None
        if not isinstance(value, dict):
            raise ConfigError("speculative config must be a JSON object", PARAM)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative config field(s) {unknown}; known: {sorted(known)}", PARAM)
        if "method" not in value:
            raise ConfigError(f"speculative config needs a method: one of {', '.join(METHODS)}", PARAM)
        return cls(**value).validate()

    def validate(self) -> SpeculativeConfig:
        if self.method not in METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}", PARAM)
        _positive_int(self.num_speculative_tokens, "num_speculative_tokens")
        if self.method == "ngram":
            _positive_int(self.prompt_lookup_min, "prompt_lookup_min")
            _positive_int(self.prompt_lookup_max, "prompt_lookup_max")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ConfigError(
                    f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                    f"({self.prompt_lookup_max})",
                    PARAM,
                )
        if self.method == "draft_model" and not self.model:
            raise ConfigError(
                'method "draft_model" needs "model": a model spec (path, .gguf, hub id, random:<shape>)', PARAM
            )
        if self.method == "early_exit":
            _positive_int(self.exit_layer, "exit_layer")
        if self.disable_by_batch_size is not None:
            _positive_int(self.disable_by_batch_size, "disable_by_batch_size")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {self.adaptive!r}", PARAM)
        return self

    def check_exit_layer(self, num_layers: int) -> None:
        """Early exit needs at least one layer left after the exit."""
        if self.method == "early_exit" and not 1 <= self.exit_layer < num_layers:
            raise ConfigError(
                f"exit_layer {self.exit_layer} is outside the model: it has {num_layers} layers, "
                f"so exit_layer must be in 1..{num_layers - 1}",
                PARAM,
            )

    def describe(self) -> str:
        k = self.num_speculative_tokens
        detail = {
            "ngram": f"n-gram {self.prompt_lookup_min}-{self.prompt_lookup_max}",
            "draft_model": f"draft {self.model} ({self.quantization})",
            "early_exit": f"exit after layer {self.exit_layer}",
        }[self.method]
        off = f", off at >= {self.disable_by_batch_size} requests" if self.disable_by_batch_size else ""
        return f"{self.method}: k={k}, {detail}{off}{', adaptive' if self.adaptive else ''}"


def _positive_int(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", PARAM)
