"""Our own AVX2 kernels (`q8_matmul.cpp` and its neighbours): built once with the system C++ compiler, loaded as
torch operators.

torch's CPU 4-bit kernel multiplies in floating point, which on an AVX2-only CPU runs at a third of
the memory bandwidth (docs/KERNELS.md, "Weights in 4 and 8 bits"). These kernels quantize the
activations to int8 per block of 32, as llama.cpp does, and multiply in integers. The extension is
built on first use into the cache folder (~20 s; `torch.utils.cpp_extension` rebuilds only when the
source or the compiler flags change); where it cannot be built or the CPU lacks AVX2, its kernels are
simply not candidates, and the chooser never sees them."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from minivllm.cache import cache_dir
from minivllm.console import progress
from minivllm.env import env_flag

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / name
    for name in (
        "q8_matmul.cpp",
        "f32_matmul.cpp",
        "paged_attention.cpp",
        "logits_reduce.cpp",
        "decode_step.cpp",
        "embedding.cpp",
        "kquant_matmul.cpp",
        "shm_collectives.cpp",
    )
]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
NO_VNNI_ENV = "MINIVLLM_NO_VNNI"  # 1: the int8 kernels' AVX2 loops on a VNNI CPU too (another CPU class's code path)
BLOCK = 32  # the activation quantization block
PAIR = 2 * BLOCK  # the 4-bit kernel steps two blocks at a time: it needs K % 64 == 0


def cpu_has_avx2() -> bool:
    """torch's own view of the CPU ("AVX2", "AVX512", ...): the kernels need AVX2, FMA and F16C."""
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


@functools.cache
def available() -> str | None:
    """None when the kernels are loaded, else why not (for the load log)."""
    if not cpu_has_avx2():
        return f"CPU capability {torch.backends.cpu.get_cpu_capability()} has no AVX2"
    try:
        _build()
    except Exception as e:  # a missing compiler or ninja must not stop the engine: torch's kernels remain
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("native int8-activation kernels unavailable (%s); using torch's kernels only", reason)
        return reason
    return None


def _build() -> None:
    from torch.utils import cpp_extension

    build_dir = cache_dir() / "extensions" / f"torch-{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not list(build_dir.glob("*.so")):
        progress("building the native kernels (once; cached) ...")
    # -fopenmp: at::parallel_for is inline OpenMP; without it the kernels would run on one thread
    cpp_extension.load(
        name="minivllm_native",
        sources=[str(p) for p in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        build_directory=str(build_dir),
        verbose=False,
    )
    _register_fakes()
    use_vnni(not vnni_turned_off())


def vnni_turned_off() -> bool:
    """MINIVLLM_NO_VNNI=1: run the AVX2 loops where VNNI ones exist. With ATEN_CPU_CAPABILITY=avx2 and
    MKL_ENABLE_INSTRUCTIONS=AVX2 an AVX-512 box then runs an AVX2 box's code paths (not its bandwidth)."""
    return env_flag(NO_VNNI_ENV)


def use_vnni(enable: bool) -> bool:
    """The int8-activation kernels' AVX512-VNNI loops (one vpdpbusd for vpmaddubsw + vpmaddwd), where
    the CPU has them; they give the same bits as the AVX2 loops. Returns whether they run."""
    return torch.ops.minivllm_native.use_vnni(enable)


def vnni_running() -> bool:
    """Whether the int8-activation kernels run their VNNI loops now."""
    return torch.ops.minivllm_native.vnni_running()


@functools.cache  # once per process: a second registration is an error
def _register_fakes() -> None:
    """Shapes for torch.compile: the compiled decode step calls these as opaque operators."""

    def output_shape(x, w, *scale):
        return x.new_empty(x.shape[0], w.shape[0])

    for op in (
        "q4_q8_linear",
        "i8_q8_linear",
        "q4_q8x2_linear",
        "i8_q8x2_linear",
        "q4_f32_linear",
        "i8_f32_linear",
        "f32_linear",
    ):
        torch.library.register_fake(f"minivllm_native::{op}")(output_shape)
    torch.library.register_fake("minivllm_native::kquant_linear")(lambda x, w, n, acts: x.new_empty(x.shape[0], n))
    torch.library.register_fake("minivllm_native::paged_decode_attention")(
        lambda q, k_pool, v_pool, block_tables, context_lens, scale: q.new_empty(q.shape)
    )
    torch.library.register_fake("minivllm_native::paged_decode_attention_window")(
        lambda q, k_pool, v_pool, block_tables, context_lens, scale, window: q.new_empty(q.shape)
    )
    torch.library.register_fake("minivllm_native::int8_embedding")(
        lambda ids, q, scale: q.new_empty(*ids.shape, q.shape[1], dtype=torch.float32)
    )
    torch.library.register_fake("minivllm_native::argmax_logsumexp")(
        lambda logits: (
            logits.new_empty(logits.shape[0], dtype=torch.long),
            logits.new_empty(logits.shape[0]),
            logits.new_empty(logits.shape[0]),
        )
    )


def q4_q8_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.minivllm_native.q4_q8_linear(x, packed)


def i8_q8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.minivllm_native.i8_q8_linear(x, q, scale)


def q4_q8x2_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.minivllm_native.q4_q8x2_linear(x, packed)


def i8_q8x2_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.minivllm_native.i8_q8x2_linear(x, q, scale)


def q4_f32_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.minivllm_native.q4_f32_linear(x, packed)


def i8_f32_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.minivllm_native.i8_f32_linear(x, q, scale)


KQUANT_ACTS = {"int8": 0, "int8x2": 1, "fp32": 2}  # kquant_matmul.cpp's numbering of activation precisions


def kquant_linear(x: torch.Tensor, packed: torch.Tensor, n: int, acts: int) -> torch.Tensor:
    """x @ W^T for a K-quant weight as `matmul_paths.pack_kquant` stores it (n output rows); `acts` one of
    KQUANT_ACTS' values."""
    return torch.ops.minivllm_native.kquant_linear(x, packed, n, acts)


def kquant_regroup(rows: torch.Tensor, kind: int, out: torch.Tensor) -> None:
    """A K-quant part's rows in the file's layout ([N in eights, row bytes]) regrouped by eight into `out` as
    grouped kind `kind` (`kquant_groups.KERNEL_TYPES`' index)."""
    torch.ops.minivllm_native.kquant_regroup(rows, kind, out)


def int8_embedding(ids: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows of an int8 table [vocab, hidden] times their scales [vocab, groups], as fp32 [*ids.shape, hidden]."""
    return torch.ops.minivllm_native.int8_embedding(ids, q, scale)


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's argmax (torch's: the first maximum, NaN counting as one), log-sum-exp and the argmax's
    log-prob (its logit minus the log-sum-exp), in two passes."""
    return torch.ops.minivllm_native.argmax_logsumexp(logits)


# decode_step.cpp's parts of a call, in the order `decode_part_times` returns them (then the whole call)
DECODE_PARTS = ("products", "attention", "rotary + K/V store", "norms + residuals", "SiLU x up", "all-reduce")


def decode_part_timing(on: bool) -> None:
    """Turn the native decode step's per-part clocks on or off (`bench profile`; off by default)."""
    torch.ops.minivllm_native.decode_part_timing(on)


def decode_part_times() -> tuple[dict[str, float], float, int]:
    """Seconds in each part (DECODE_PARTS) and in whole calls, and the calls timed, since the last read;
    the sums then restart from zero."""
    *parts, whole, calls = torch.ops.minivllm_native.decode_part_times()
    return dict(zip(DECODE_PARTS, parts, strict=True)), whole, int(calls)


def reduces_logits(logits: torch.Tensor) -> bool:
    """Whether `argmax_logsumexp` can take these logits (contiguous fp32 on this CPU, kernels built)."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.is_contiguous()
        and logits.shape[1] > 0
        and available() is None
    )
