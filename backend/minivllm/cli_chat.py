"""Terminal chat and one-shot generation, streaming tokens as they are produced."""

from __future__ import annotations

import sys

from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling.params import SamplingParams
from minivllm.text.tokenizer_utils import load_chat_template_prompt


def stream_one(
    engine: LLMEngine, prompt: str | None, prompt_ids: list[int] | None, params: SamplingParams, request_id: str = "cli"
) -> str:
    engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_ids)
    text = ""
    while engine.has_work():
        for out in engine.step():  # each output carries the text that is new
            delta = out.outputs[0].text if out.outputs else ""
            sys.stdout.write(delta)
            sys.stdout.flush()
            text += delta
    sys.stdout.write("\n")
    return text


def interactive_chat(engine: LLMEngine, params: SamplingParams, system: str | None = None) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print(f"Chatting with {engine.loaded.name}. Empty line or Ctrl-D to quit, /reset to start over.")
    for turn in range(1_000_000):
        try:
            user = input("\nyou> ").strip()
        except EOFError:
            break
        if not user:
            break
        if user == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": user})
        ids = load_chat_template_prompt(engine.tokenizer, messages)
        sys.stdout.write("bot> ")
        reply = stream_one(engine, None, ids, params, request_id=f"chat-{turn}")
        messages.append({"role": "assistant", "content": reply})
