"""Each step's profile for the dashboard: where its time went and its roofline floors.

Collected only while some dashboard client watches (`watch`): otherwise a step costs one set check.
While on, a native decode step (decode_step.cpp) times its own parts from inside the call (~10 us a
step); any other path (a prefill, the compiled or eager layers, CUDA graphs) gives the engine's coarse
phases only, and `profile_source` says which. The floors: the bytes the step reads (weights in the form
its kernels stream them, plus each sequence's K/V context) over the machine's streaming bandwidth, and
its FLOPs over the products' peak rate (engine/roofline.py).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

from minivllm.core.scheduler import SchedulerOutput
from minivllm.engine.roofline import MachineRates, machine_rates
from minivllm.kernels.cpu import native
from minivllm.loader import LoadedModel
from minivllm.loader.install_quantized import streamed_bytes
from minivllm.model.attention import KVCache

# decode_step.cpp's parts (native.DECODE_PARTS) as the wire's part names
NATIVE_PART_NAMES = {
    "products": "products",
    "attention": "attention",
    "rotary + K/V store": "kv_store",
    "norms + residuals": "norms_act",
    "SiLU x up": "norms_act",
    "all-reduce": "all_reduce",
}
MAX_KEPT_ROW_COUNTS = 512  # weight bytes are kept per row count (the kernel plan changes with it)


@dataclass
class StepProfile:
    """What StepFinished carries beyond the phases (see its fields)."""

    source: str
    parts_ms: dict[str, float]
    weight_bytes: int
    kv_bytes: int
    flops: float
    rates: MachineRates

    def wire_fields(self) -> dict:
        bandwidth, peak = self.rates.bandwidth_gbs, self.rates.peak_gflops
        return {
            "profile_source": self.source,
            "profile_parts_ms": self.parts_ms,
            "weight_bytes_read": self.weight_bytes,
            "kv_bytes_read": self.kv_bytes,
            "flops": self.flops,
            "bandwidth_gbs": bandwidth,
            "peak_gflops": peak,
            "memory_floor_ms": (self.weight_bytes + self.kv_bytes) / (bandwidth * 1e6),
            "compute_floor_ms": self.flops / (peak * 1e6),
        }


class StepProfiler:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.rates = machine_rates(loaded.device)  # once per machine: the cache file keeps it
        self._watchers: set[Hashable] = set()
        self._lock = threading.Lock()  # watchers change on the server's loop, the engine thread reads
        self._clocks_on = False
        self._weight_bytes: dict[int, int] = {}
        self._kv_bytes_per_token = 0

    # ---- the switch: any thread -----------------------------------------------------------------

    def watch(self, watcher: Hashable, on: bool) -> None:
        """`watcher` (a dashboard client) opened (on) or closed its profile panel; a gone client is off."""
        with self._lock:
            (self._watchers.add if on else self._watchers.discard)(watcher)

    @property
    def wanted(self) -> bool:
        return bool(self._watchers)

    # ---- the engine thread ----------------------------------------------------------------------

    def bind(self, kv_cache: KVCache | None) -> None:
        """A rebuilt pool: the bytes a cached token costs to read (K and V, every layer)."""
        self._weight_bytes.clear()
        if kv_cache is not None:
            tokens = (kv_cache.num_blocks + (kv_cache.scratch_block is not None)) * kv_cache.block_size
            self._kv_bytes_per_token = kv_cache.num_bytes // max(tokens, 1)

    def begin_step(self) -> None:
        """Turn the native part clocks on or off to follow the switch, before the step runs."""
        wanted = self.wanted and self._native_step() is not None
        if wanted != self._clocks_on:
            if wanted:
                native.decode_part_times()  # count from zero
            native.decode_part_timing(wanted)
            self._clocks_on = wanted

    def profile(self, sched: SchedulerOutput, phases_ms: dict[str, float]) -> StepProfile | None:
        """This step's profile, or None while nobody watches. `phases_ms`: schedule, forward, sample,
        postprocess."""
        if not self.wanted:
            return None
        source, parts = "coarse", dict(phases_ms)
        if self._clocks_on:
            native_parts, whole, calls = native.decode_part_times()
            if calls > 0:
                source, parts = "native", _native_parts(phases_ms, native_parts, whole)
        rows = sum(s.num_tokens for s in sched.scheduled)
        context = sum(s.start + s.num_tokens for s in sched.scheduled)
        return StepProfile(
            source,
            {k: round(v, 4) for k, v in parts.items()},
            self._weights_read(rows),
            context * self._kv_bytes_per_token,
            self._flops(sched, rows, len(sched.sampled())),
            self.rates,
        )

    def _native_step(self):
        return getattr(self.loaded.model, "native_step", None)

    def _weights_read(self, rows: int) -> int:
        if rows not in self._weight_bytes:
            if len(self._weight_bytes) >= MAX_KEPT_ROW_COUNTS:
                self._weight_bytes.clear()
            self._weight_bytes[rows] = streamed_bytes(self.loaded.model, rows)
        return self._weight_bytes[rows]

    def _flops(self, sched: SchedulerOutput, rows: int, num_sampled: int) -> float:
        """2 per multiply-add: every row through the layers' products (routed experts: only the active
        ones), the LM head for the sampled rows, and attention's QK and PV over each token's context."""
        c = self.loaded.config
        h, heads, hd = c.hidden_size, c.num_attention_heads, c.head_dim
        attn_products = h * (heads + 2 * c.num_key_value_heads) * hd + heads * hd * h
        dense, moe = 3 * h * c.intermediate_size, c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
        mlps = sum(moe + c.num_experts * h if n in c.moe_layers else dense for n in range(c.num_hidden_layers))
        per_row = c.num_hidden_layers * attn_products + mlps
        # a chunk of n tokens from `start` attends over start+1 .. start+n tokens
        attended = sum(s.num_tokens * s.start + s.num_tokens * (s.num_tokens + 1) // 2 for s in sched.scheduled)
        attention = 4 * c.num_hidden_layers * heads * hd * attended
        return float(2 * (per_row * rows + h * c.vocab_size * num_sampled) + attention)


def _native_parts(phases_ms: dict[str, float], parts_s: dict[str, float], whole_s: float) -> dict[str, float]:
    """The forward phase split by the native call's clocks: its parts, the rest of the call, and what
    ran outside it (embedding, final LM-head product, Python and dispatch)."""
    out = {"schedule": phases_ms["schedule"]}
    for name, seconds in parts_s.items():
        key = NATIVE_PART_NAMES[name]
        out[key] = out.get(key, 0.0) + seconds * 1e3
    out["layers_other"] = max(0.0, (whole_s - sum(parts_s.values())) * 1e3)
    out["outside_layers"] = max(0.0, phases_ms["forward"] - whole_s * 1e3)
    out["sample"], out["postprocess"] = phases_ms["sample"], phases_ms["postprocess"]
    return out
