"""Load a Hugging Face checkpoint: a local directory (config.json + safetensors) or a hub id
resolved through the local Hugging Face cache (no network at run time)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minivllm.loader.weights import CorruptCheckpointError, iter_progress


class ModelNotFoundError(FileNotFoundError):
    pass


def looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def resolve_hub_id(repo_id: str) -> Path:
    """Find a cached snapshot of `repo_id`; never downloads."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id, local_files_only=True, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
            )
        )
    except Exception as exc:
        raise ModelNotFoundError(
            f"model '{repo_id}' is neither a local directory nor in the Hugging Face cache, and it is "
            f"not downloaded at run time. Fetch it first on a machine with internet: "
            f"`hf download {repo_id}` (then copy ~/.cache/huggingface), or pass "
            f"--model /path/to/a/local/directory"
        ) from exc


def load_hf_config(directory: Path):
    from transformers import AutoConfig

    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        json.loads(config_file.read_text())
        return AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError) as exc:
        raise CorruptCheckpointError(f"{config_file} is not a valid model config: {exc}") from exc


def generation_eos_ids(directory: Path) -> tuple[int, ...]:
    """The stop tokens generation_config.json lists (Qwen's chat models stop at <|im_end|> there, which
    config.json may not name); none when it is absent or unreadable."""
    try:
        eos = json.loads((directory / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int))


def load_hf_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception:  # a weights-only directory: serve token ids only
        return None


def load_safetensors(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{directory} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
                for key in iter_progress(keys, len(keys), f"loading {path.name}"):
                    tensors[key] = f.get_tensor(key).to(dtype)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptCheckpointError(f"cannot read {path}: {exc}") from exc
    return tensors
