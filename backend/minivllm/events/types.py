"""Every wire type of mini-vllm's event stream: a tagged union of msgspec Structs on `type`.

The dashboard, recordings and tests are all built from these. Block events carry the affected
sequence's whole new block table and the affected blocks' new ref counts, so folding the stream
onto a snapshot needs no engine knowledge (see `minivllm.events.fold`). JSON Schema is generated
from this module (`minivllm schema`) and TypeScript types from that schema.
Block hashes travel as hex strings: 64-bit integers do not survive JavaScript numbers.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

RequestStateName = Literal["WAITING", "PREFILL", "DECODE", "PREEMPTED", "FINISHED"]
FinishReason = Literal["stop", "length", "abort", "error"]


class Event(msgspec.Struct, tag_field="type", kw_only=True):
    seq: int = 0  # monotonic sequence number, assigned by the event bus
    ts: float = 0.0  # engine time in seconds since the engine started


# ---- requests --------------------------------------------------------------------------------


class RequestArrived(Event, tag="request_arrived"):
    request_id: str
    prompt_tokens: int
    max_tokens: int
    n: int
    priority: int
    sampling: dict[str, Any]  # the request's non-default SamplingParams, for display
    prompt_preview: str  # first characters of the prompt


class RequestStateChanged(Event, tag="request_state"):
    request_id: str
    state: RequestStateName
    previous: RequestStateName | None
    reason: str  # why, in words: "admitted", "prompt fully computed", "preempted: out of KV blocks", ...
    finish_reason: FinishReason | None = None


class SeqAdded(Event, tag="seq_added"):
    """A sequence joined a request: the first one at arrival, forks for n > 1 and beams."""

    request_id: str
    seq_id: int
    parent_seq_id: int | None
    num_tokens: int
    num_prompt_tokens: int


class SeqRemoved(Event, tag="seq_removed"):
    request_id: str
    seq_id: int
    reason: str


class TokenGenerated(Event, tag="token"):
    request_id: str
    seq_id: int
    token_id: int
    text: str  # the detokenized text delta (may be "" while a multi-byte character is incomplete)
    logprob: float | None
    drafted: bool = False  # proposed by speculative decoding and accepted by the target model
    # structured outputs: the share of the vocabulary the grammar allowed at this token (None: unconstrained)
    allowed_fraction: float | None = None


class SpecVerified(Event, tag="spec_verified"):
    """Speculative decoding: the target model checked a sequence's drafted tokens in one pass.
    The first `accepted` drafts were kept; then `token_id` came from the target itself (the
    correction at the first rejected draft, or a bonus token when all were accepted)."""

    request_id: str
    seq_id: int
    step: int
    method: str  # ngram | draft_model | early_exit
    proposed: list[int]
    accepted: int
    token_id: int


# ---- scheduling ------------------------------------------------------------------------------


class ScheduledChunk(msgspec.Struct):
    request_id: str
    seq_id: int
    start: int  # tokens already computed before this chunk
    num_tokens: int
    num_draft: int = 0  # of num_tokens, drafted tokens to verify (speculative decoding)


class StepScheduled(Event, tag="step_scheduled"):
    step: int
    prefill: list[ScheduledChunk]
    decode: list[ScheduledChunk]
    budget_used: int
    budget: int
    num_running: int
    num_waiting: int
    preempted: list[str]
    queue_head: str | None  # request id at the head of the waiting queue, if it could not start
    queue_head_reason: str | None  # why it waits: "token budget exhausted", "out of KV blocks", ...


class StepFinished(Event, tag="step_finished"):
    step: int
    duration_ms: float
    num_tokens: int  # tokens run through the model
    num_generated: int  # tokens sampled
    schedule_ms: float
    forward_ms: float
    sample_ms: float
    postprocess_ms: float
    experts_touched: int | None = None  # a MoE model's distinct experts run, summed over its MoE layers
    # the step profile (engine/step_profile.py), only while a dashboard client watches it: "" none,
    # "native" (the native decode step's own part clocks), "coarse" (the phases above only)
    profile_source: str = ""
    profile_parts_ms: dict[str, float] = {}  # the step's time by part, in order; they sum to about duration_ms
    weight_bytes_read: int = 0  # weights the step's kernels stream
    kv_bytes_read: int = 0  # K/V context its attention reads
    flops: float = 0.0
    bandwidth_gbs: float = 0.0  # streaming bandwidth, measured once per machine
    peak_gflops: float = 0.0  # a large product's rate, measured once per machine
    memory_floor_ms: float = 0.0  # (weight + K/V bytes) / bandwidth
    compute_floor_ms: float = 0.0  # flops / peak


class MemorySplit(msgspec.Struct, kw_only=True):
    """Where the serving process's resident memory goes, in bytes (engine/memory_view.py). The parts
    sum to `rss`; a part is None where this platform cannot tell (off Linux: all but rss)."""

    rss: int
    weights: int | None = None  # the model's weight tensors' resident pages (shared storage once)
    kv_cache: int | None = None  # the KV pool's resident pages: the blocks ever written
    compiled: int | None = None  # .so files under the inductor / minivllm caches
    torch: int | None = None  # torch's own .so files
    libraries: int | None = None  # every other .so file
    other: int | None = None  # the rest: Python heap, server, tokenizer, temporaries
    kv_reserved: int = 0  # the KV pool's allocation (resident or not)
    clamped: bool = False  # the named parts summed past rss: `other` reads 0
    cost_ms: float = 0.0  # what this measurement took


class DiskTierStats(msgspec.Struct, kw_only=True):
    """The prefix cache's disk tier (--kv-offload-dir), counted since the engine was (re)configured."""

    blocks_written: int = 0
    blocks_read: int = 0  # read back into the pool: prefix hits and resumed requests served from disk
    blocks_recomputed: int = 0  # kept on disk, but recomputing was measured cheaper than reading
    write_errors: int = 0  # a full disk or another I/O error: those blocks stay RAM-only
    corrupt_files: int = 0  # failed their checksum or named other tokens: deleted, recomputed
    files: int = 0
    bytes_on_disk: int = 0
    max_bytes: int = 0


class MetricsSample(Event, tag="metrics"):
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of blocks referenced
    num_cached_free_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int  # prompt tokens found (cumulative)
    num_preemptions: int  # cumulative
    prompt_tokens: int  # cumulative
    generation_tokens: int  # cumulative
    generation_throughput: float  # tokens/s over the last sample window
    prompt_throughput: float
    rss_bytes: int = 0  # the serving process's resident memory, as `ps` shows it (0: unknown)
    # speculative decoding, cumulative (vLLM's spec_decode_* counters)
    spec_num_drafts: int = 0  # verify steps with at least one drafted token
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []  # [i]: drafts accepted at draft position i
    memory: MemorySplit | None = None  # sampled every few seconds, repeated in between
    disk_tier: DiskTierStats | None = None  # None: no disk tier


# ---- KV blocks -------------------------------------------------------------------------------


class BlocksAllocated(Event, tag="blocks_allocated"):
    request_id: str
    seq_id: int
    block_ids: list[int]
    table: list[int]  # the sequence's whole block table after the change


class BlocksShared(Event, tag="blocks_shared"):
    request_id: str
    seq_id: int
    block_ids: list[int]
    ref_counts: list[int]
    prefix_hit: bool  # True: reused from the prefix cache; False: a fork (n > 1, beams)
    table: list[int]


class BlocksFreed(Event, tag="blocks_freed"):
    """A sequence dropped references: its whole table (`whole_table`, when it finished, was
    preempted or pruned), one block it just copied (copy-on-write), or the tail blocks that held
    only rejected drafts (speculative decoding's rollback). Blocks whose ref count reached 0 are
    free, and stay reusable from the prefix cache while they keep their hash."""

    request_id: str
    seq_id: int
    block_ids: list[int]
    ref_counts: list[int]
    whole_table: bool
    table: list[int] | None = None  # the sequence's table after the change, unless whole_table
    dropped: bool = False  # the blocks left a sliding KV window (--kv-window) or the model's attention window


class BlocksCached(Event, tag="blocks_cached"):
    """Full blocks entered the prefix cache: computed by a sequence, or read back from the disk tier
    (`from_disk`: then free and owned by no sequence, request_id "" and seq_id -1)."""

    request_id: str
    seq_id: int
    block_ids: list[int]
    hashes: list[str]
    from_disk: bool = False


class BlocksEvicted(Event, tag="blocks_evicted"):
    block_ids: list[int]
    hashes: list[str]
    to_disk: bool = False  # a disk tier keeps their data (--kv-offload-dir): a later prefix hit reads it back


class BlocksCopied(Event, tag="blocks_copied"):
    """Copy-on-write: a shared partial block was duplicated before one branch wrote to it."""

    request_id: str
    seq_id: int
    src_block_ids: list[int]
    block_ids: list[int]
    ref_counts: list[int]  # of the sources, after the change
    table: list[int]


class ConfigChanged(Event, tag="config_changed"):
    """The engine was rebuilt with a new configuration; a fresh snapshot follows."""

    config: EngineInfo


AnyEvent = Union[  # noqa: UP007 - msgspec needs the Union form for a tagged union alias
    RequestArrived,
    RequestStateChanged,
    SeqAdded,
    SeqRemoved,
    TokenGenerated,
    StepScheduled,
    StepFinished,
    MetricsSample,
    BlocksAllocated,
    BlocksShared,
    BlocksFreed,
    BlocksCached,
    BlocksEvicted,
    BlocksCopied,
    ConfigChanged,
    SpecVerified,
]


# ---- snapshot --------------------------------------------------------------------------------


class EngineInfo(msgspec.Struct):
    model: str
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    dtype: str
    device: str
    # read-only, fixed at load; defaults keep recordings made before quantization readable
    quantization: str = "none"  # what the weights run in, e.g. "int4 g32 (embedding and LM head: int8 g32)"
    weight_bytes: int = 0  # bytes the weights occupy as stored (packed copies included)
    weight_fp32_bytes: int = 0  # the same parameters in fp32, for the ratio
    kernels: list[str] = []  # one line per layer group: which kernel serves which row counts
    speculative: str | None = None  # the speculative-decoding setup in words; None: off
    compilation: str = "eager"  # how decode steps run: compiled (torch.compile) or eager, and why
    kv_cache_dtype: str = "float32"  # the KV pool's element type (--kv-cache-dtype, resolved)
    kv_offload_bytes: int = 0  # the prefix cache's disk tier, at most this many bytes (--kv-offload-size); 0: none
    kv_window: int = 0  # StreamingLLM's sliding KV window in tokens (--kv-window); 0: full attention
    kv_sinks: int = 0  # attention-sink tokens kept with it (--kv-sinks); 0 without a window
    attention_window: int = 0  # the model's sliding-window attention in tokens (Mistral): blocks leave it; 0: none


class SeqState(msgspec.Struct):
    seq_id: int
    parent_seq_id: int | None
    num_tokens: int
    num_prompt_tokens: int
    num_computed: int
    block_table: list[int]
    finished: bool = False


class RequestState(msgspec.Struct):
    request_id: str
    state: RequestStateName
    prompt_tokens: int
    max_tokens: int
    n: int
    priority: int
    arrival_ts: float
    sampling: dict[str, Any]
    prompt_preview: str
    output_tokens: int = 0
    first_token_ts: float | None = None
    finish_ts: float | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    seqs: list[SeqState] = []


class BlockState(msgspec.Struct):
    block_id: int
    ref_count: int
    block_hash: str | None  # hex; set while the block is registered in the prefix cache


class Snapshot(msgspec.Struct, tag_field="type", tag="snapshot"):
    seq: int  # sequence number of the last event folded into this snapshot
    ts: float
    step: int
    config: EngineInfo
    requests: list[RequestState]
    blocks: list[BlockState]


# ---- WebSocket messages ----------------------------------------------------------------------


class EventBatch(msgspec.Struct, tag_field="type", tag="events"):
    events: list[AnyEvent]


class Resync(msgspec.Struct, tag_field="type", tag="resync"):
    """The client fell behind (its queue overflowed, or `since` is gone): a snapshot follows."""

    reason: str


WsMessage = Union[Snapshot, EventBatch, Resync]  # noqa: UP007 - as AnyEvent


# ---- engine replicas (--data-parallel-size) ----------------------------------------------------


class ReplicaState(msgspec.Struct, kw_only=True):
    """One engine replica as GET /v1/replicas shows it."""

    id: int
    node: str = ""  # host:pid of the replica's actor
    alive: bool = True
    running: int = 0
    waiting: int = 0
    routed: int = 0  # requests the router sent here
    prefix_hit_rate: float = 0.0  # of the prompt blocks routed here, the share the router matched
    dead_reason: str | None = None


class RoutingDecision(msgspec.Struct, kw_only=True):
    """Where the router sent one request, and why: `prefix` (the replica held the most leading
    blocks), `least_loaded` (none held any) or `round_robin`."""

    request_id: str
    replica: int
    matched_blocks: int = 0
    prompt_blocks: int = 0
    reason: Literal["prefix", "least_loaded", "round_robin"] = "least_loaded"


class ReplicasState(msgspec.Struct, kw_only=True):
    """GET /v1/replicas: the replicas and the router's latest decisions (oldest first); no replicas
    when one engine serves."""

    policy: str = ""
    replicas: list[ReplicaState] = []
    decisions: list[RoutingDecision] = []


# ---- recordings ------------------------------------------------------------------------------


class RecordingHeader(msgspec.Struct, tag_field="type", tag="header"):
    version: int
    created: str  # ISO 8601
    snapshot: Snapshot


class RecordingFooter(msgspec.Struct, tag_field="type", tag="footer"):
    """Last line of a finished recording: the engine's own snapshot when recording stopped.
    Folding every event onto the header's snapshot must give this state."""

    snapshot: Snapshot


RECORDING_VERSION = 1


def hash_hex(block_hash: int | None) -> str | None:
    return None if block_hash is None else format(block_hash & 0xFFFFFFFFFFFFFFFF, "016x")
