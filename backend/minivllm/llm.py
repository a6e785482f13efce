"""The offline Python API, with vLLM's names: `LLM(...).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from minivllm.engine.config import EngineConfig
from minivllm.engine.factory import create_engine
from minivllm.engine.outputs import OutputAccumulator, RequestOutput
from minivllm.quant.policy import QuantConfig
from minivllm.sampling.params import SamplingParams
from minivllm.text.tokenizer_utils import load_chat_template_prompt

Message = dict[str, str]


class LLM:
    """Loads a model (the embedded SmolLM2 by default) and runs batches of prompts to completion
    with continuous batching."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        quantization: str | QuantConfig = "auto",
        speculative_config: str | dict | None = None,
        enforce_eager: bool | None = None,
        **engine_options,
    ):
        self.engine = create_engine(
            model,
            EngineConfig(**engine_options),
            dtype=dtype,
            device=device,
            seed=seed,
            quantization=quantization,
            speculative_config=speculative_config,
            enforce_eager=enforce_eager,
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """With `kv_offload_dir`: write the prefix cache's blocks to disk, for the next process to reuse."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        items = (
            [(p, None) for p in prompts] if prompts is not None else [(None, list(t)) for t in prompt_token_ids or []]
        )
        params = self._params_list(sampling_params, len(items))
        ids = []
        try:
            for (text, token_ids), p in zip(items, params):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, text, p, prompt_token_ids=token_ids)
                ids.append(request_id)
        except Exception:  # one bad prompt fails the call: leave none of its requests behind
            for request_id in ids:
                self.engine.abort_request(request_id)
            self._run(ids, False)  # hands out the abort outputs
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_ids = [load_chat_template_prompt(self.tokenizer, conv) for conv in conversations]
        return self.generate(prompt_token_ids=token_ids, sampling_params=sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _params_list(params, count: int) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return list(params)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        whole = OutputAccumulator()
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="generating", unit="req")
        while self.engine.has_work():
            for out in map(whole.add, self.engine.step()):
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in request_ids]
