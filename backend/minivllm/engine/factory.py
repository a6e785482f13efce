"""The one way an engine is built: load the model, then the engine around it. The CLI (through
`engine_args.build_engine`), the offline `LLM` class and the server all come here."""

from __future__ import annotations

import dataclasses

import torch

from minivllm.engine import tp_workers
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.loader import LoadedModel, load_model
from minivllm.model.compiled import eager_requested, use_compilation
from minivllm.quant.policy import QuantConfig
from minivllm.spec_decode.config import SpeculativeConfig
from minivllm.spec_decode.factory import load_draft


def create_engine(
    model: str | None = None,
    config: EngineConfig | None = None,
    *,
    dtype: str = "float32",
    device: str | None = None,
    seed: int = 0,
    quantization: str | QuantConfig = "auto",
    threads: int | None = None,
    speculative_config: str | dict | SpeculativeConfig | None = None,
    enforce_eager: bool | None = None,
    tensor_parallel_size: int | None = None,
) -> LLMEngine:
    """`model`: an HF directory, a .gguf file, a cached hub id, random:<shape>, or None for the
    embedded SmolLM2. `threads`: torch's CPU threads (None: torch's choice). `speculative_config`:
    vLLM's JSON object (a string or a dict), None for no speculative decoding. `enforce_eager`: no
    torch.compile (vLLM's name; None: $MINIVLLM_ENFORCE_EAGER); otherwise CPU decode steps run compiled.
    `tensor_parallel_size`: ranks the model is split over (engine/tp_workers.py; overrides `config`'s);
    `threads` are then per rank (default 1)."""
    config = config or EngineConfig()
    if tensor_parallel_size is not None:
        config = dataclasses.replace(config, tensor_parallel_size=tensor_parallel_size)
    speculative = SpeculativeConfig.parse(speculative_config)  # a bad config fails before any load
    if threads:
        torch.set_num_threads(threads)
    load_args = dict(
        spec=model, dtype=dtype, device=device, seed=seed, max_model_len=config.max_model_len, quantization=quantization
    )
    tp = tp_workers.prepare(config, speculative, threads, load_args)  # None: one process
    try:
        loaded = load_model(**load_args)
        eager = eager_requested(enforce_eager)
        use_compilation(loaded.model, loaded.device, eager)
        tp_workers.connect(tp, loaded, load_args, threads, eager)
        return engine_for(loaded, config, speculative=speculative)
    except BaseException:
        tp_workers.stop(tp)
        raise


def engine_for(
    loaded: LoadedModel,
    config: EngineConfig | None = None,
    *,
    speculative: SpeculativeConfig | None = None,
    draft: LoadedModel | None = None,
) -> LLMEngine:
    """An engine around a model already loaded: benchmarks compare several engines over one load.
    `draft`: a draft model already loaded for `speculative` (loaded here when None and needed)."""
    config = config or EngineConfig()
    if speculative is not None and draft is None:
        draft = load_draft(speculative, loaded, config.max_model_len)
    return LLMEngine(loaded, config, speculative=speculative, draft=draft)
