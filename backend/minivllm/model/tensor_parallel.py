"""Tensor parallelism, Megatron-style, over torch.distributed: which slice of each weight a rank holds and
the collectives that put the slices' results back together.

  column-parallel  q|k|v split by heads (H/N query heads and KV/N KV heads a rank, so a rank's query heads
                   read only its own KV heads) and gate|up by intermediate columns: no communication
  row-parallel     o_proj and down_proj over the rank's input slice, then an all-reduce (sum)
  vocabulary       the embedding's and the LM head's rows in N ranges: a masked lookup then an all-reduce;
                   the head's logit shards all-gathered into the whole vocabulary

A quantized weight is sliced in its stored blocks: rows freely, input columns at block boundaries, or in
floats where a slice would cut a block (one log line). The KV pool of a rank holds its KV heads only: the
model's config says KV/N heads. The engine's side (launching ranks, sending each step) is
engine/tp_workers.py.

Ranks the engine spawned on one machine sum and gather fp32 tensors through a shared-memory segment
(kernels/cpu/shm_collectives.cpp: microseconds, where gloo's loopback TCP took ~1.5 ms a collective), which
the native decode step also calls between its products; ranks across machines (torchrun) use the group.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from minivllm.arith import ceil_div
from minivllm.console import progress
from minivllm.errors import ConfigError
from minivllm.kernels.cpu import native
from minivllm.model.config import LlamaConfig
from minivllm.quant.formats import (
    BLOCK,
    KQUANT_BYTES,
    SUPER_BLOCK,
    Int4Weight,
    Int8Weight,
    KQuantWeight,
    QuantizedWeight,
    concat_rows,
)

Weight = torch.Tensor | QuantizedWeight


@dataclass
class TPGroup:
    """This process's place among the tensor-parallel ranks. `group` carries the tensors (gloo or NCCL),
    `steps` the engine's step messages (gloo, no timeout worth the name: a worker idles as long as the
    server does). `processes`: the workers rank 0 spawned, None under torchrun."""

    rank: int
    world: int
    group: object | None = None
    steps: object | None = None
    processes: list | None = field(default=None, repr=False)
    stopped: bool = False  # rank 0 has told the workers to exit (engine/tp_workers.py stop)
    shm: torch.Tensor | None = field(default=None, repr=False)  # the shared segment, where the ranks share memory

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place where it can be (the result is returned either way)."""
        if not self._through_segment(x):
            dist.all_reduce(x, group=self.group)
            return x
        x = x.contiguous()
        torch.ops.minivllm_native.shm_all_reduce_(x, self.shm, self.rank, self.world)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (one shape on all), in rank order."""
        if not self._through_segment(x):
            shards = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(shards, x, group=self.group)
            return shards
        return list(torch.ops.minivllm_native.shm_all_gather(x.contiguous(), self.shm, self.rank, self.world))

    def _through_segment(self, x: torch.Tensor) -> bool:
        """The segment carries fp32 CPU tensors; the same on every rank, so all take one path."""
        return self.shm is not None and x.device.type == "cpu" and x.dtype == torch.float32


SEGMENT_SLOT_BYTES = 2 << 20  # per rank and generation; bigger tensors go through in chunks


def create_segment(world: int) -> str | None:
    """Rank 0: a zeroed shared-memory file for `world` ranks' collectives, or None where there is no
    shared-memory file system (the ranks then use their gloo group). Unlinked once every rank mapped it."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"minivllm-tp-{uuid.uuid4().hex}")
    try:
        with open(path, "wb") as f:
            f.truncate(torch.ops.minivllm_native.shm_segment_bytes(world, SEGMENT_SLOT_BYTES))
    except OSError as exc:
        progress(f"tensor parallelism: no shared-memory segment ({exc}); collectives go over gloo")
        return None
    return path


def map_segment(path: str | None, rank: int, world: int) -> torch.Tensor | None:
    """This rank's mapping of the segment (None: no segment), its pid written there (`shm_join`)."""
    if path is None or native.available() is not None:  # a spawned worker loads our operators here
        return None
    shm = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
    torch.ops.minivllm_native.shm_join(shm, rank, world)
    return shm


_current: TPGroup | None = None


def current() -> TPGroup | None:
    """The group a model loaded now is sharded for (None: no tensor parallelism)."""
    return _current


def set_current(group: TPGroup | None) -> None:
    global _current
    _current = group


def shard_config(cfg: LlamaConfig, world: int) -> LlamaConfig:
    """One rank's config: its heads, KV heads and intermediate columns; the vocabulary stays whole (the
    logits are gathered). Refuses splits that do not divide, naming the numbers."""
    if cfg.moe_layers:
        raise ConfigError("tensor parallelism does not split mixture-of-experts layers", "tensor_parallel_size")
    sizes = {
        "attention heads": cfg.num_attention_heads,
        "KV heads": cfg.num_key_value_heads,
        "intermediate size": cfg.intermediate_size,
    }
    bad = [f"{name} ({n})" for name, n in sizes.items() if n % world]
    if bad:
        fits = [d for d in range(1, 17) if all(n % d == 0 for n in sizes.values())]
        raise ConfigError(
            f"--tensor-parallel-size {world} must divide the model's {', '.join(bad)}; "
            f"sizes that split {cfg.name}: {', '.join(map(str, fits))}",
            "tensor_parallel_size",
        )
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world,
        num_key_value_heads=cfg.num_key_value_heads // world,
        intermediate_size=cfg.intermediate_size // world,
    )


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """The vocabulary rows a rank holds: equal ranges of ceil(V/N), the last one shorter."""
    per = ceil_div(vocab, world)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def shard_state(state: Mapping[str, Weight], cfg: LlamaConfig, tp: TPGroup, dtype: torch.dtype) -> dict[str, Weight]:
    """Model-named weights (the full model's) -> this rank's slices; norms and output biases stay whole."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv_parts = (q, kv, kv)
    gate_up_parts = (cfg.intermediate_size, cfg.intermediate_size)
    vocab = vocab_range(cfg.vocab_size, tp.rank, tp.world)
    out = {}
    for name, value in state.items():
        if name.endswith(("qkv_proj.weight", "qkv_bias")):
            out[name] = _split_parts(value, qkv_parts, tp)
        elif name.endswith("gate_up_proj.weight"):
            out[name] = _split_parts(value, gate_up_parts, tp)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            per = value.shape[1] // tp.world
            out[name] = _columns(name, value, tp.rank * per, (tp.rank + 1) * per, dtype)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = _rows(value, *vocab)
        else:
            out[name] = value
    return out


def _split_parts(value: Weight, parts: tuple[int, ...], tp: TPGroup) -> Weight:
    """The rank's share of each row part (q, k, v or gate, up), fused again."""
    pieces, offset = [], 0
    for size in parts:
        per = size // tp.world
        pieces.append(_rows(value, offset + tp.rank * per, offset + (tp.rank + 1) * per))
        offset += size
    return torch.cat(pieces) if isinstance(value, torch.Tensor) else concat_rows(pieces)


def _rows(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, torch.Tensor):
        return w[start:end].clone()
    if isinstance(w, Int4Weight):
        return Int4Weight(w.packed[start:end].clone(), w.group_size)
    if isinstance(w, Int8Weight):
        return Int8Weight(w.q[start:end].clone(), w.scale[start:end].clone(), w.group_size)
    parts, offset = [], 0  # a K-quant weight's parts are stacked by rows
    for kind, data in w.parts:
        lo, hi = max(start - offset, 0), min(end - offset, data.shape[0])
        if lo < hi:
            parts.append((kind, data[lo:hi].clone()))
        offset += data.shape[0]
    return KQuantWeight(parts)


def _columns(name: str, w: Weight, start: int, end: int, dtype: torch.dtype) -> Weight:
    """Input columns start:end, cut at the weight's block boundaries (a per-channel int8 row keeps its scale)."""
    if isinstance(w, torch.Tensor):
        return w[:, start:end].contiguous()
    if isinstance(w, Int8Weight) and w.per_channel:
        return Int8Weight(w.q[:, start:end].contiguous(), w.scale.clone(), end - start)
    block = w.group_size
    if start % block or end % block:
        progress(
            f"tensor parallelism: {name}'s input slice {start}:{end} cuts its blocks of {block}: "
            f"this rank runs that slice in {str(dtype).removeprefix('torch.')}"
        )
        return w.dequantize(dtype)[:, start:end].contiguous()
    if isinstance(w, Int8Weight):
        return Int8Weight(w.q[:, start:end].contiguous(), w.scale[:, start // block : end // block].clone(), block)
    if isinstance(w, Int4Weight):
        return Int4Weight(_int4_columns(w.packed, w.shape[1] // BLOCK, start // BLOCK, end // BLOCK), block)
    return KQuantWeight(
        [
            (kind, data[:, start // SUPER_BLOCK * KQUANT_BYTES[kind] : end // SUPER_BLOCK * KQUANT_BYTES[kind]].clone())
            for kind, data in w.parts
        ]
    )


def _int4_columns(packed: torch.Tensor, blocks: int, first: int, last: int) -> torch.Tensor:
    """Blocks first:last of Q4_1 rows laid out as d[blocks] (fp16), m[blocks] (fp16), 16 nibble bytes a block."""
    d = packed[:, 2 * first : 2 * last]
    m = packed[:, 2 * (blocks + first) : 2 * (blocks + last)]
    nibbles = packed[:, 4 * blocks + 16 * first : 4 * blocks + 16 * last]
    return torch.cat([d, m, nibbles], dim=1).contiguous()


def local_vocab_config(cfg: LlamaConfig, tp: TPGroup) -> LlamaConfig:
    """The config the rank's modules are built from: its vocabulary rows only (model.config keeps them all)."""
    start, end = vocab_range(cfg.vocab_size, tp.rank, tp.world)
    return dataclasses.replace(cfg, vocab_size=end - start)


def install_collectives(model: nn.Module, tp: TPGroup) -> None:
    """The all-reduces after the row-parallel products and the vocabulary's lookup, and the logits' gather,
    as forward hooks on the modules that need them (whatever the loader put in their place)."""
    for layer in model.layers:
        for product in (layer.self_attn.o_proj, layer.mlp.down_proj):
            product.register_forward_hook(lambda _module, _args, output: tp.all_reduce(output))
    start, end = vocab_range(model.config.vocab_size, tp.rank, tp.world)
    lookup = _VocabLookup(tp, start, end)
    model.embed_tokens.register_forward_pre_hook(lookup.local_ids)
    model.embed_tokens.register_forward_hook(lookup.combine)
    model.lm_head.register_forward_hook(_gather_logits(tp, model.config.vocab_size))
    model.tp = tp


class _VocabLookup:
    """Ids outside this rank's rows look up row 0 and are zeroed; the ranks' sum is every id's row."""

    def __init__(self, tp: TPGroup, start: int, end: int):
        self.tp, self.start, self.end = tp, start, end
        self.mask: torch.Tensor | None = None

    def local_ids(self, _module, args):
        ids = args[0]
        self.mask = (ids >= self.start) & (ids < self.end)
        return (torch.where(self.mask, ids - self.start, 0), *args[1:])

    def combine(self, _module, _args, output: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(output * self.mask.unsqueeze(-1).to(output.dtype))


def _gather_logits(tp: TPGroup, vocab: int):
    per = ceil_div(vocab, tp.world)

    def hook(_module, _args, output: torch.Tensor) -> torch.Tensor:
        shard = output.contiguous()
        if shard.shape[-1] < per:  # the last range is shorter: padded so every rank sends one size
            shard = torch.nn.functional.pad(shard, (0, per - shard.shape[-1]))
        return torch.cat(tp.all_gather(shard), dim=-1)[..., :vocab]

    return hook


def restrict_steps(model: nn.Module) -> None:
    """Decode steps under tensor parallelism: no compiled step (its graphs span layers, with no place for the
    all-reduce each layer needs); the native step only where the ranks share memory, for it all-reduces
    inside its one call (the shared segment); else the eager layers with the group's collectives."""
    tp = model.tp
    model.compiled, model.may_compile, model.may_capture = None, False, False
    ranks = f"tensor parallelism over {tp.world} ranks"
    model.eager_reason = f"{ranks}: the compiled step has no all-reduce between layers"
    if tp.shm is None and model.native_step is not None:
        model.native_step = None
        model.eager_reason = f"{ranks} without shared memory: the native step has no all-reduce inside"
