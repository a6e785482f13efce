"""What a GGUF file's metadata converts to, kept in the cache folder so later loads skip the conversion.

Why: the `gguf` package parses every metadata field when it opens a file, and a Llama vocabulary is
~100,000 strings read one by one (3.5 s for the embedded model on 2 cores); transformers opens the
file again for the config and again for the tokenizer, so a load parsed it three times (~12 s of a
~15 s load). The converted tokenizer is saved with transformers' own `save_pretrained`, the config as
our LlamaConfig's fields, and the tensor table (name, GGML type, shape, byte offset) as JSON, so the
tensors are read from a memory map of the file at those offsets with no parse at all.

An entry is keyed by the file's resolved path, size and modification time and by the versions of the
libraries that converted it, and appears atomically (written under a temporary name, then renamed):
a changed file, a library upgrade or an interrupted write never serves stale data. A cache folder
that cannot be written costs only the speed-up.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from minivllm.cache import cache_dir, read_json
from minivllm.model.config import LlamaConfig, UnsupportedModelError

log = logging.getLogger(__name__)

FORMAT = 2  # bump when what an entry holds changes
TENSOR_TABLE = "tensors.json"
LLAMA_CONFIG = "llama-config.json"  # our LlamaConfig's fields


@dataclass
class TensorRecord:
    """One tensor of a GGUF file: its GGML type name, its shape (innermost dimension first, as ggml
    lists it) and its bytes (a view of the memory-mapped file)."""

    name: str
    kind: str
    shape: list[int]
    raw: np.ndarray  # uint8

    def values(self) -> np.ndarray:
        """The stored values as the gguf reader shapes them: floats for F32/F16, else rows of bytes."""
        if self.kind == "F32":
            return self.raw.view(np.float32)
        if self.kind == "F16":
            return self.raw.view(np.float16)
        rows = int(np.prod(self.shape[1:])) if len(self.shape) > 1 else 1
        return self.raw.reshape(rows, -1)


def entry_dir(path: Path) -> Path:
    """This file's folder in the cache (it may not exist yet)."""
    stat = path.stat()
    key = f"{FORMAT}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_converter_versions()}"
    return cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@functools.cache
def _converter_versions() -> str:
    """The libraries whose conversion an entry holds (looked up once: a metadata scan each time)."""
    return "|".join(f"{lib} {metadata.version(lib)}" for lib in ("gguf", "transformers"))


def load_config(path: Path, name: str) -> LlamaConfig:
    """Our config for the file, named `name`. The first load derives it from the HF config transformers
    reads from the file (AutoConfig) and keeps our fields; later loads read them back without
    transformers' config classes, whose imports alone cost ~50 MiB of resident memory and ~1.5 s
    (torch.distributed.tensor, sympy)."""
    file = entry_dir(path) / LLAMA_CONFIG
    values = read_json(file)
    if isinstance(values, dict):
        try:
            return dataclasses.replace(LlamaConfig.from_json_dict(values), name=name)
        except (TypeError, ValueError) as exc:  # a damaged entry: derive it again, and replace it below
            log.warning("ignoring the cached config %s (%s)", file, exc)
    from transformers import AutoConfig

    config = LlamaConfig.from_hf(AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name), name)
    config = _with_what_the_tensors_say(config, path)
    config = _with_what_the_metadata_says(config, path)
    _store(file, lambda target: target.write_text(json.dumps(config.to_json_dict())))
    return config


def _with_what_the_tensors_say(config: LlamaConfig, path: Path) -> LlamaConfig:
    """transformers' GGUF reader maps neither `attention.key_length` nor an attention-bias flag, so a head
    size other than hidden/heads (Qwen3's) and the biases (Qwen3's `attention_bias`) come from the
    tensors: the K product's rows per KV head, and whether the first layer's biases are there; and a
    mixture of experts' shapes (`_expert_shapes`)."""
    records = {r.name: r for r in tensor_records(path)}
    k_proj = records.get("blk.0.attn_k.weight")
    if k_proj is None or len(k_proj.shape) != 2:
        return config
    return dataclasses.replace(
        config,
        head_dim=k_proj.shape[1] // config.num_key_value_heads,
        qkv_bias="blk.0.attn_q.bias" in records,
        o_bias="blk.0.attn_output.bias" in records,
        **_expert_shapes(config, records),
    )


def _expert_shapes(config: LlamaConfig, records: dict) -> dict:
    """A MoE file's sparse layers (those with stacked experts), expert count and expert width, from the
    tensors: transformers' reader maps no `expert_feed_forward_length`, and a file says nothing of
    which layers are sparse."""
    sparse = tuple(i for i in range(config.num_hidden_layers) if f"blk.{i}.ffn_gate_exps.weight" in records)
    if not sparse:
        return {}
    _, width, count = records[f"blk.{sparse[0]}.ffn_gate_exps.weight"].shape  # ggml: innermost first
    return {"moe_layers": sparse, "num_experts": int(count), "moe_intermediate_size": int(width)}


STOP_FIELDS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _with_what_the_metadata_says(config: LlamaConfig, path: Path) -> LlamaConfig:
    """What transformers' GGUF reader leaves out for some architectures: the end-of-turn stop tokens, the
    sliding window (the file's, not a config class's default: a Mistral file read as `mistral` would get
    4096), the rotary width (`rope.dimension_count`, partial rotary), Gemma's settings and Phi-3's LongRoPE."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = str(_field(reader, "general.architecture"))
    window = _field(reader, f"{arch}.attention.sliding_window")
    rotary_dim = _field(reader, f"{arch}.rope.dimension_count")
    config = dataclasses.replace(
        config,
        eos_token_ids=_with_stop_tokens(config.eos_token_ids, reader),
        sliding_window=int(window) if window else None,
        rotary_dim=int(rotary_dim) if rotary_dim and int(rotary_dim) < config.head_dim else None,
    )
    if config.family.startswith("gemma"):
        config = _gemma_settings(config, reader, arch)
    if config.moe_layers:
        config = _moe_settings(config, reader, arch)
    return _with_longrope(config, reader, arch)


def _moe_settings(config: LlamaConfig, reader, arch: str) -> LlamaConfig:
    """The experts a token uses (`expert_used_count`), and a `llama` file with experts read as Mixtral (llama.cpp
    writes Mixtral so): Llama's decoder with every layer sparse and the top-k weights renormalised."""
    used = _field(reader, f"{arch}.expert_used_count")
    if used is None:
        raise UnsupportedModelError(f"the GGUF file has expert tensors but no {arch}.expert_used_count")
    mixtral = config.family == "llama"
    return dataclasses.replace(
        config,
        family="mixtral" if mixtral else config.family,
        num_experts_per_tok=int(used),
        norm_topk_prob=True if mixtral else config.norm_topk_prob,
    )


def _with_stop_tokens(eos: tuple[int, ...], reader) -> tuple[int, ...]:
    """llama.cpp ends generation at the end-of-turn / end-of-message tokens too (Gemma's <end_of_turn>,
    Phi-3's <|end|>), which the chat templates close a reply with and `eos_token_id` may not name."""
    stops = [int(i) for key in STOP_FIELDS if (i := _field(reader, key)) is not None]
    return (*eos, *(i for i in dict.fromkeys(stops) if i not in eos))


def _with_longrope(config: LlamaConfig, reader, arch: str) -> LlamaConfig:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the factors as tensors, the lengths as fields."""
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if not factors:
        return config
    original = int(_field(reader, f"{arch}.rope.scaling.original_context_length"))
    attention = _field(reader, f"{arch}.rope.scaling.attn_factor")
    factor = config.max_position_embeddings / original
    if attention is None:  # transformers' default
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    scaling = {
        "rope_type": "longrope",
        "long_factor": [float(v) for v in factors["rope_factors_long.weight"].data],
        "short_factor": [float(v) for v in factors["rope_factors_short.weight"].data],
        "original_max_position_embeddings": original,
        "attention_factor": float(attention),
    }
    return dataclasses.replace(config, rope_scaling=scaling)


GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales these by hidden / heads, not head_dim


def _gemma_settings(config: LlamaConfig, reader, arch: str) -> LlamaConfig:
    """Gemma's settings a GGUF holds as llama.cpp reads them: soft-caps and linear rope scaling from the
    fields, and the attention scale by llama.cpp's rule (a file has no `query_pre_attn_scalar`: head_dim
    ** -0.5, but (hidden / heads) ** -0.5 for the 27B models, which is what their configs say)."""
    attn_cap = _field(reader, f"{arch}.attn_logit_softcapping")
    final_cap = _field(reader, f"{arch}.final_logit_softcapping")
    big = config.num_hidden_layers == GEMMA_27B_LAYERS.get(arch)
    scaling = config.rope_scaling
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    return dataclasses.replace(
        config,
        attn_softcap=float(attn_cap) if attn_cap else None,
        final_softcap=float(final_cap) if final_cap else None,
        attn_scale=(config.hidden_size / config.num_attention_heads if big else config.head_dim) ** -0.5,
        rope_scaling=scaling,
    )


def _field(reader, key: str):
    """A scalar metadata field's value (a string decoded), or None where the file has none."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else value[0]


def load_tokenizer(path: Path):
    """The tokenizer (with its chat template) transformers builds from the file, from the cache when it
    holds it."""
    from transformers import AutoTokenizer

    return _cached(
        entry_dir(path) / "tokenizer",
        "tokenizer_config.json",
        lambda: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name),
        AutoTokenizer.from_pretrained,
    )


def tensor_records(path: Path) -> list[TensorRecord]:
    """Every tensor of the file, its bytes mapped from the file. The first load takes the table from
    the gguf reader and keeps it; later loads read it back."""
    table_path = entry_dir(path) / TENSOR_TABLE
    table = read_json(table_path)
    if table is None:
        table = _read_table(path)
        _store(table_path, lambda target: target.write_text(json.dumps(table)))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if table and table[-1]["offset"] + table[-1]["bytes"] > data.size:
        raise ValueError(f"{path} is shorter than its tensor table says")
    return [TensorRecord(t["name"], t["kind"], t["shape"], data[t["offset"] : t["offset"] + t["bytes"]]) for t in table]


def _read_table(path: Path) -> list[dict]:
    from gguf import GGUFReader

    table = [
        {
            "name": t.name,
            "kind": t.tensor_type.name,
            "shape": [int(s) for s in t.shape],
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
        }
        for t in GGUFReader(str(path)).tensors
    ]
    return sorted(table, key=lambda t: t["offset"])


def _cached(folder: Path, marker: str, convert, reload):
    """`reload(folder)` when the folder holds `marker`, else `convert()`, saved there."""
    if (folder / marker).is_file():
        try:
            return reload(str(folder))
        except Exception as exc:  # noqa: BLE001 - a damaged entry: convert again, and replace it below
            log.warning("ignoring the cached conversion in %s (%s)", folder, exc)
    value = convert()
    _store(folder, lambda target: value.save_pretrained(str(target)))
    return value


def _store(target: Path, write) -> None:
    """Makes `target` (a file or a folder) what `write(staging)` writes, atomically: written under a
    temporary name beside it, then renamed onto it."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        if target.suffix:  # a file: written inside the staging folder, moved out of it
            write(staging / target.name)
            os.replace(staging / target.name, target)
            staging.rmdir()
            return
        write(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except OSError as exc:
        log.warning("cannot cache %s (%s); the next load converts the file again", target, exc)
