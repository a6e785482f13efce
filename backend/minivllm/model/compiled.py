"""Decode steps through torch.compile (inductor): one compiled graph of G decoder layers serves every group.

Why groups of layers and not the whole model: the groups share one graph (their weights are the
graph's inputs, not constants), so a cold compile costs seconds on 2 cores where a 30-layer graph
measured 82 s per shape; and each call's fixed cost (dynamo's guards, the wrapper) is paid once per
group, not per layer. The group loop stays in Python, so early exit keeps working (a remainder
smaller than a group runs eagerly) and hidden-state capture runs eagerly. What the compiler wins:
the ~25 small operators around each layer's GEMMs (norm, rotary, residuals, SwiGLU, the
activation conversions of the quantized kernels) become a few fused C++ loops.

Only steps whose every row is one sequence's single token take this path (decode steps, the steady
state of a chat); steps with multi-token chunks (prefill, speculative verification) run eagerly,
since their per-chunk shapes would need a graph each. Shapes: one graph for every row count and
block-table width (both marked dynamic up front, `mark_sizes_dynamic`), plus one per kernel row
range where a layer's kernel depends on the row count. `ModelRunner.warmed_up` drives the compile at
start-up and checks the row counts that could need another graph, so a running server never
compiles, and then lets dynamo check only the guards that tell its graphs apart
(`CompiledLayers.steady`).

A failure (no C++ compiler, an operator inductor cannot lower) disables compilation for the process
with one warning naming the cause, and the step goes on eagerly: it never takes the server down.
"""

from __future__ import annotations

import types

import torch
import torch.fx.experimental._config as fx_config

from minivllm.console import progress
from minivllm.env import env_flag
from minivllm.model import vec_isa_cache
from minivllm.model.attention import native_decode_ready, reads_pool_natively, triton_decode_ready
from minivllm.model.native_step import NativeDecodeStep

RECOMPILE_LIMIT = 64  # graphs per code object: row ranges x widths stay far below this


MAX_LAYERS_PER_GRAPH = 6


def run_layer(layer, x, rope, k_pool, v_pool, meta):
    """One decoder layer: the eager path."""
    return layer(x, rope, k_pool, v_pool, meta)


def run_layers(layers, x, rope, k_pools, v_pools, meta):
    """A group of consecutive decoder layers: the function the compiled step compiles."""
    for layer, k_pool, v_pool in zip(layers, k_pools, v_pools):
        x = layer(x, rope, k_pool, v_pool, meta)
    return x


def layers_per_graph(num_layers: int) -> int:
    """The largest divisor of the layer count up to MAX_LAYERS_PER_GRAPH: every group has one size,
    so one graph family serves them all. Each compiled call costs ~0.1-0.2 ms of guards and Python
    wrapper on 2 cores; 6 layers a call measured 16% faster a step than 1 (30 layers, one sequence),
    for ~11 s instead of ~4 s of compiling per shape."""
    return max(g for g in range(1, MAX_LAYERS_PER_GRAPH + 1) if num_layers % g == 0)


def _own_copy(fn):
    """The function with a code object of its own: dynamo keeps its graphs per code object, so each
    model's graphs (and their recompile budget) stay apart from another model's in the process."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


class CompiledLayers:
    """Runs groups of `group` decoder layers through the compiled graph, or eagerly once compiling
    has failed."""

    def __init__(self, group: int = 1, backend: str = "inductor"):
        torch.compiler.assume_constant_result(native_decode_ready)  # marks it in place, for every graph
        torch.compiler.assume_constant_result(triton_decode_ready)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.backend, self.group = backend, group
        # Guards on our modules' attributes cost ~0.26 ms a call (measured: dynamo's cache lookup, 0.35 ->
        # 0.09 ms, 6 layers a graph) and guard nothing that changes: a model's modules are fixed once
        # loaded (kernel plans are chosen before the first compile). Tensor and shape guards stay.
        self.step = torch.compile(
            _own_copy(run_layers),
            backend=backend,
            dynamic=None,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )
        self.error: str | None = None
        # After warm-up (ModelRunner.warmed_up) dynamo checks only the guards that told its graphs apart
        # there (none with one graph; a kernel plan's row edges): every graph a step can need exists
        # then, and nothing else guarded changes. -0.6 ms a step at 1 row, -1.7 at 8 (of 10.5 / 36,
        # measured A/B in one process).
        self.steady = False

    @property
    def active(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        if self.error is not None:
            return f"eager (compiling failed: {self.error})"
        return f"compiled ({self.backend}, decode steps, {self.group} layers a graph; prefill chunks eager)"

    def run(self, layers, x, rope, kv_cache, meta, num_layers: int) -> tuple[torch.Tensor, int]:
        """Runs the whole groups among the first `num_layers` layers; returns x and how many layers
        ran (an early exit's remainder runs eagerly: a smaller group would be another graph)."""
        done = num_layers - num_layers % self.group
        layers = tuple(layers)  # slicing a ModuleList builds a ModuleList (~0.1 ms of module registration)
        with self._calling(x, rope, meta):
            for i in range(0, done, self.group):
                x = self(
                    layers[i : i + self.group],
                    x,
                    rope,
                    tuple(kv_cache.k[i : i + self.group]),
                    tuple(kv_cache.v[i : i + self.group]),
                    meta,
                )
        return x, done

    def _calling(self, x, rope, meta):
        """The settings around a step's calls: in steady state only the guard skipping; before it (the
        warm-up, or tests that turn it off) what shapes the compile, which the steady path never does."""
        if self.steady:
            return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        mark_sizes_dynamic(x, rope, meta)
        return fx_config.patch(backed_size_oblivious=True)

    def __call__(self, layers, x, rope, k_pools, v_pools, meta):
        if self.error is None:
            try:
                return self.step(layers, x, rope, k_pools, v_pools, meta)
            except torch._dynamo.exc.TorchDynamoException as exc:  # the compiler's failure, not the step's
                self.disable(exc)
        return run_layers(layers, x, rope, k_pools, v_pools, meta)

    def disable(self, exc: BaseException) -> None:
        # the compiler wraps the exception that names the problem (a missing g++, an unlowerable op)
        while (inner := getattr(exc, "inner_exception", None) or exc.__cause__) is not None:
            exc = inner
        lines = str(exc).strip().splitlines()
        self.error = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")
        progress(f"WARNING: torch.compile failed, running eager from now on ({self.error})")


def eager_requested(enforce_eager: bool | None) -> bool:
    """The explicit choice, else $MINIVLLM_ENFORCE_EAGER (the CLI's flag reads the same variable)."""
    if enforce_eager is not None:
        return enforce_eager
    return env_flag("MINIVLLM_ENFORCE_EAGER")


def use_compilation(model: torch.nn.Module, device: torch.device | str, enforce_eager: bool) -> None:
    """Give the model its native decode step where its kernels allow one, and leave the compiled step
    to `compiled_step_for` (the runner's warm-up), or say why it runs eagerly."""
    model.may_compile = model.may_capture = False
    if enforce_eager:
        model.eager_reason = "--enforce-eager"
    elif getattr(model, "eager_only", None) is not None:  # no compiled step or graph serves it (MoE): on a CPU,
        model.eager_reason = model.eager_only  # the native step may still take its decode steps
        if torch.device(device).type == "cpu":
            model.native_step = NativeDecodeStep.for_model(model)
        if model.native_step is None:
            progress(f"decode steps run eagerly: {model.eager_reason}")
    elif torch.device(device).type == "cuda" and getattr(model.config, "attention_window", None) is not None:
        model.eager_reason = "sliding-window attention (the decode graphs are captured without a window)"
        progress(f"decode steps run eagerly: {model.eager_reason}")
    elif torch.device(device).type == "cuda":  # decode steps replay CUDA graphs (ModelRunner.warmed_up)
        model.may_capture = True
        # Graphs of compiled layers (inductor + Triton) only on request: side by side on an H200 they
        # decoded TinyLlama bf16 at 0.69-0.97x the graphs of eager kernels, after a 30 s cold compile
        # (docs/KERNELS.md, "CUDA graphs for decode steps").
        model.may_compile = env_flag("MINIVLLM_CUDA_COMPILE")
        model.eager_reason = "CUDA graphs not captured"
    elif torch.device(device).type != "cpu":
        model.eager_reason = f"no compiled step or graphs on {torch.device(device).type}"
    else:
        model.native_step = NativeDecodeStep.for_model(model)
        model.may_compile = True


def compiled_step_for(model: torch.nn.Module, max_rows: int, k_pool: torch.Tensor) -> CompiledLayers | None:
    """The model's compiled step, built now if some decode step of up to `max_rows` rows over this
    pool needs one: where the native step runs them all, none is built. Why not always: importing
    dynamo and inductor costs ~130 MiB of resident memory and ~2 s of start-up that such a process
    would never use (the embedded model's default)."""
    if not _native_runs_every_step(model, max_rows, k_pool):
        attach_compiled_step(model)
    return model.compiled


def _native_runs_every_step(model: torch.nn.Module, max_rows: int, k_pool: torch.Tensor) -> bool:
    """Whether the native step serves every decode step up to `max_rows` rows: kernel plans change
    only at their edges, which `decode_row_counts` covers on both sides."""
    step = model.native_step
    return (
        step is not None
        and reads_pool_natively(k_pool)
        and all(step.kinds(rows) is not None for rows in decode_row_counts(model, max_rows))
    )


def attach_compiled_step(model: torch.nn.Module) -> None:
    """Builds the model's compiled step unless it has one or may not compile (bench compile forces one
    beside a native step that needs none)."""
    if model.compiled is not None or not model.may_compile:
        return
    try:
        vec_isa_cache.use_kept_probe()
        model.compiled = CompiledLayers(layers_per_graph(len(model.layers)))
    except Exception as exc:  # noqa: BLE001 - e.g. a Python torch.compile does not support
        model.may_compile = False
        model.eager_reason = f"torch.compile unavailable: {type(exc).__name__}: {exc}"
        progress(f"WARNING: {model.eager_reason}")


def decode_row_counts(model: torch.nn.Module, max_rows: int) -> list[int]:
    """Row counts that reach every graph a decode step can need: 1, 2, and each side of every row
    count where a quantized layer switches kernel (an MKL-packed layer picks its bucket inside one
    opaque operator: no graph of its own)."""
    from minivllm.quant.linear import QuantLinear

    edges: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            edges |= {rows for rows, _ in module.plan[:-1]}
    counts = {1, 2, max_rows} | {e + d for e in edges for d in (-1, 0, 1)}
    return sorted(r for r in counts if 1 <= r <= max_rows)


def mark_sizes_dynamic(x: torch.Tensor, rope: tuple[torch.Tensor, ...], meta) -> None:
    """Tells dynamo up front that a decode step's row count and block-table width vary, so its first
    graph is the one for every step. Learnt from later calls instead, the first graph was fixed to
    one row and one width and each was traced again (2-3 graphs: 8-9 s of a warm start, 54 s cold,
    instead of 5-6 s and 34 s). With `backed_size_oblivious` (set around the calls) a size of 1 is
    not special either; the code in the graph avoids the views that would ask whether a row count is
    1 (`RotaryEmbedding.rotate`, `gather_blocks`, `decode_attention`). A hint only: it sets an
    attribute on this step's tensors."""
    for tensor in (x, *rope, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    torch._dynamo.maybe_mark_dynamic(meta.decode_block_tables, 1)
    if meta.decode_mask is not None:  # only the portable attention reads one
        torch._dynamo.maybe_mark_dynamic(meta.decode_mask, 0)
        torch._dynamo.maybe_mark_dynamic(meta.decode_mask, 3)


def warm_up_shapes(model: torch.nn.Module, max_rows: int, max_width: int) -> list[tuple[int, int]]:
    """(rows, block-table width) per warm-up step: every row count of `decode_row_counts`, at widths
    from 2 up (the runner pads every table to 2 or more)."""
    widths = [min(w, max_width) for w in (2, 3, 4)]
    return [(rows, widths[i % 3]) for i, rows in enumerate(decode_row_counts(model, max_rows))]


def graph_count() -> int:
    """Graphs dynamo has compiled in this process (for the no-recompile check)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
