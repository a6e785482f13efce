"""Small tokenizer helpers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _model_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def load_chat_template_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template into token ids.

    Raises ``ValueError`` (naming the model) when the tokenizer has no chat
    template.  The template itself supplies any BOS / role tokens, so no extra
    special tokens are added.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"Model {_model_name(tokenizer)!r} has no chat template; "
            "use the completions API with a plain prompt instead."
        )
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        **({"tools": tools} if tools else {}),
        **template_kwargs,
    )
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # BatchEncoding / dict
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], (list, tuple)):  # batched result for a single conversation
        ids = list(ids[0])
    return [int(i) for i in ids]
