"""The matmul paths a quantized weight can run through, each a small callable holding what it needs.

Which path is fastest depends on the CPU and on the number of rows (tokens) in the product: on an
AVX2-only CPU torch's 4-bit kernel is ~12x slower with fp32 activations than with bf16 ones, on an
AVX-512 CPU the gap is small, and at 32+ rows the picture changes again. So a weight offers several
candidates and `chooser.py` times them at load. All candidates of one weight compute the same
product up to the activation precision they name:

  int4pack/fp32   torch's CPU 4-bit kernel, fp32 activations and scales: exact w.r.t. the format
  int4pack/bf16   the same packed weight, activations and scales rounded to bf16
  int8pack/fp32   torch's int8 weight-only kernel (per-channel scales), fp32 activations
  int8pack/bf16   the same, bf16 activations
  int4avx2/int8   our AVX2 kernel (native.py): activations quantized to int8 per block of 32, integer
                  products (llama.cpp's Q4_1 x Q8_1 arithmetic); K % 64 == 0
  int8avx2/int8   the same for per-channel int8 weights (K % 32 == 0)
  int4avx2/int8x2, int8avx2/int8x2
                  the same with each activation also keeping its rounding remainder as a second int8
                  (x = d/128 * (128q + r)): ~15 bits per block, two integer products per pair
  kquant/int8, kquant/int8x2, kquant/fp32
                  our kernels for GGUF K-quants (Q4_K, Q5_K, Q6_K) in their own super-blocks, the three
                  activation precisions as above (native/kquant_matmul.cpp); K % 256 == 0
  kquant-dequant  a K-quant weight dequantized once at load (gguf-py), then a plain matmul: where our
                  kernels cannot run (no AVX2, CUDA)
  int4avx2/fp32, int8avx2/fp32
                  our AVX2 kernels with fp32 activations: the weights dequantized in registers, exact
                  (the same packed weights as the int8-activation kernels: one copy serves both)
  int8pack+exact64/bf16, int8avx2+exact64/int8
                  an LM head only: the kernel, then each row's 64 highest logits recomputed in fp32
  int4pack-cuda   torch's CUDA 4-bit kernel (bf16 only, tensor cores)
  dequant         dequantize, then a plain matmul in the compute dtype (CUDA int8; exact)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minivllm.arith import ceil_div
from minivllm.kernels.cpu import native
from minivllm.quant import kquant_groups
from minivllm.quant.formats import (
    Int4Weight,
    Int8Weight,
    KQuantWeight,
    QuantizedWeight,
    to_per_channel,
    weight_bytes,
)

NATIVE_ACTS = ("int8", "int8x2", "fp32")  # our kernels' activation precisions, coarsest first
CPU_INT4_ROW_MULTIPLE = 16  # torch's CPU int4 packing needs N % 16 == 0: pad with zero rows


class Kernel:
    """y = x @ W^T for one quantized weight through one path."""

    name = "?"
    exact = True  # False when activations are rounded to a lower precision
    # Activations keep >= ~15 significant bits (fp32, int8x2): outputs within ~1e-4 of the exact product,
    # close enough that greedy output follows the fp32-dequantized model (bench quality: 5/5 prompts)
    precise = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """What this path keeps alive (for memory accounting)."""
        raise NotImplementedError

    def streamed_bytes(self, rows: int) -> int:
        """Bytes of weights one call over `rows` rows reads: by default everything it keeps."""
        return sum(weight_bytes(t) for t in self.tensors())


class Int4PackCPU(Kernel):
    """`pack()`: the weight in torch's packing, shared by the activation-dtype variants. Built at
    first use (a timing or a call), so a load whose kept kernel plan names another kernel never
    builds it: ~0.5 bytes a weight less at the load's peak, and its packing time."""

    def __init__(self, pack: Callable[[], _Int4Pack], act_dtype: torch.dtype):
        self._pack, self.act_dtype = pack, act_dtype
        self.name = f"int4pack/{_short(act_dtype)}"
        self.exact = self.precise = act_dtype == torch.float32

    @functools.cached_property
    def packed(self) -> _Int4Pack:
        return self._pack()

    @functools.cached_property
    def scales_zeros(self) -> torch.Tensor:
        return self.packed.scales_zeros.to(self.act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(
            x.to(self.act_dtype), self.packed.weight, self.packed.group_size, self.scales_zeros
        )
        if self.packed.padded:
            y = y[:, : self.packed.out_features]
        return y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed.weight, self.scales_zeros]


class _Int4Pack:
    """One packed copy of an Int4Weight, shared by the activation-dtype variants."""

    def __init__(self, weight: Int4Weight):
        n, _ = weight.shape
        padded = ceil_div(n, CPU_INT4_ROW_MULTIPLE) * CPU_INT4_ROW_MULTIPLE
        q, scale, zero = weight.q, weight.scale, weight.zero
        if padded != n:
            pad = padded - n
            q = F.pad(q, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        self.weight = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
        self.group_size, self.out_features, self.padded = weight.group_size, n, padded != n


class Int8PackCPU(Kernel):
    """`per_channel()`: the weight with one scale per row, as torch's kernel takes it (a grouped weight
    re-rounded), built at first use as Int4PackCPU's packing is."""

    def __init__(self, per_channel: Callable[[], Int8Weight], act_dtype: torch.dtype):
        self._per_channel, self.act_dtype = per_channel, act_dtype
        self.name = f"int8pack/{_short(act_dtype)}"
        self.exact = self.precise = act_dtype == torch.float32

    @functools.cached_property
    def q(self) -> torch.Tensor:
        return self._per_channel().q

    @functools.cached_property
    def scale(self) -> torch.Tensor:
        return self._per_channel().scale[:, 0].to(self.act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(self.act_dtype), self.q, self.scale).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


class _NativeKernel(Kernel):
    """Our kernels: one op per activation precision (NATIVE_ACTS); the precisions share the weight."""

    PREFIX = "?"
    OPS: dict = {}

    def _use(self, acts: str) -> None:
        self.exact, self.precise = acts == "fp32", acts != "int8"
        self.name, self.op = f"{self.PREFIX}/{acts}", self.OPS[acts]


class Int4Native(_NativeKernel):
    """Our 4-bit kernel with activations in `acts`. `packed`: an Int4Weight's Q4_1 rows, as stored."""

    PREFIX = "int4avx2"
    OPS = {"int8": native.q4_q8_linear, "int8x2": native.q4_q8x2_linear, "fp32": native.q4_f32_linear}

    def __init__(self, packed: torch.Tensor, acts: str = "int8"):
        self.packed = packed
        self._use(acts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x.float().contiguous(), self.packed).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


class Int8Native(_NativeKernel):
    """Our int8 kernel with activations in `acts`. `scale`: fp32 [N] (per channel) or [N, K/32] (per block,
    fp32 or fp16, e.g. GGUF Q8_0 as stored: no re-rounding, no copy)."""

    PREFIX = "int8avx2"
    OPS = {"int8": native.i8_q8_linear, "int8x2": native.i8_q8x2_linear, "fp32": native.i8_f32_linear}

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, acts: str = "int8"):
        self.q, self.scale = q, scale.contiguous()
        self._use(acts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x.float().contiguous(), self.q, self.scale).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


KQUANT_MAGIC = 0x4B515731  # native/kquant_matmul.cpp's header: its kMagic
KQUANT_HEADER_BYTES = 64


def pack_kquant(weight: KQuantWeight) -> torch.Tensor:
    """The weight as our K-quant kernels read it: one uint8 tensor, a 64-byte header (int32: magic, parts, then
    each part's type and rows) and the parts' super-blocks back to back, their bytes as the file has them,
    or regrouped by eight rows (kquant_groups) when every part's rows come in eights.
    One tensor per weight, whatever its parts: the decode step passes it like any other weight."""
    kinds = kquant_groups.kernel_kinds(weight.parts)
    numbers = [kquant_groups.KERNEL_TYPES.index(kind) for kind in kinds]
    fields = [KQUANT_MAGIC, len(kinds)] + [
        v for number, (_, data) in zip(numbers, weight.parts) for v in (number, data.shape[0])
    ]
    if len(fields) * 4 > KQUANT_HEADER_BYTES:
        raise ValueError(f"a K-quant weight of {len(kinds)} parts: at most {KQUANT_HEADER_BYTES // 8 - 1}")
    supers = weight.shape[1] // KQuantWeight.group_size
    sizes = [data.shape[0] * supers * kquant_groups.super_bytes(kind) for kind, (_, data) in zip(kinds, weight.parts)]
    packed = torch.empty(KQUANT_HEADER_BYTES + sum(sizes), dtype=torch.uint8)
    header = torch.zeros(KQUANT_HEADER_BYTES // 4, dtype=torch.int32)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int32)
    packed[:KQUANT_HEADER_BYTES] = header.view(torch.uint8)
    offset = KQUANT_HEADER_BYTES
    for kind, (_, data), size in zip(kinds, weight.parts, sizes):
        kquant_groups.write_part(kind, data, packed[offset : offset + size].view(data.shape[0], -1))
        offset += size
    return packed


class KQuantNative(_NativeKernel):
    """Our K-quant kernel with activations in `acts`. `packed`: `pack_kquant`'s tensor, shared by the
    activation precisions."""

    PREFIX = "kquant"
    OPS = native.KQUANT_ACTS

    def __init__(self, packed: torch.Tensor, out_features: int, acts: str = "int8"):
        self.packed, self.out_features = packed, out_features
        self._use(acts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return native.kquant_linear(x.float().contiguous(), self.packed, self.out_features, self.op).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]


class KQuantDequant(Kernel):
    """A K-quant weight dequantized once (gguf-py's arithmetic), then F.linear: where our kernels cannot run."""

    name = "kquant-dequant"

    def __init__(self, weight: KQuantWeight, device: torch.device, dtype: torch.dtype):
        self.weight = weight.dequantize().to(device, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


def _native_int8_scales(weight: Int8Weight) -> torch.Tensor | None:
    """The native int8 kernels' scales: [N] per channel, [N, K/32] per block of 32 (a coarser group
    repeats its scale), None for groups that do not tile 32."""
    if weight.per_channel:
        return weight.scale[:, 0].float().contiguous()
    if weight.group_size % native.BLOCK:
        return None
    if weight.group_size == native.BLOCK:  # the weight's own scales (fp16 or fp32), not a copy (Q8_0: ~0.1 GiB at 1B)
        scale = weight.scale if weight.scale.dtype in (torch.float16, torch.float32) else weight.scale.float()
        return scale.contiguous()
    return weight.scale.float().repeat_interleave(weight.group_size // native.BLOCK, dim=1).contiguous()


def _native_fits(weight: QuantizedWeight) -> bool:
    multiple = {Int4Weight: native.PAIR, KQuantWeight: KQuantWeight.group_size}.get(type(weight), native.BLOCK)
    return weight.shape[1] % multiple == 0 and native.available() is None


class ExactTopLogits(Kernel):
    """An LM head through a fast bf16 kernel, then each row's TOP highest logits recomputed in fp32
    from the int8 rows. bf16 logits step by 0.06-0.125 at the usual logit sizes, so two candidate
    tokens often tie exactly and the pick turns on rounding (measured: the default answered "What is
    the capital of France?" with nonsense, and with this, "Paris", as fp32 does). The tokens that can
    win (greedy, top-k, top-p) get exact logits; the bf16 rest only feeds the softmax's denominator.
    Costs a top-k and TOP dot products per row; rows stay independent of each other."""

    TOP = 64

    def __init__(self, fast: Kernel, weight: Int8Weight):
        self.fast, self.weight = fast, weight
        self.name = fast.name.replace("/", f"+exact{self.TOP}/")
        self.exact = False  # exact where it matters, not everywhere: "exact" still means fp32 throughout
        self.precise = fast.precise

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.fast(x)
        top = logits.topk(min(self.TOP, logits.shape[-1]), dim=-1).indices  # [rows, TOP]
        rows = self.weight.rows(top.flatten()).dequantize(x.dtype).view(*top.shape, -1)  # [rows, TOP, K]
        # multiply-and-sum, not bmm: a batched GEMM picks its kernel by batch size, a row-wise sum
        # gives every row the same bits alone and in any batch
        exact = (rows * x.unsqueeze(1)).sum(-1)
        return logits.scatter_(1, top, exact.to(logits.dtype))

    @property
    def q(self) -> torch.Tensor:
        return self.weight.q

    def tensors(self) -> list[torch.Tensor]:
        return self.fast.tensors() + [self.weight.q, self.weight.scale]

    def streamed_bytes(self, rows: int) -> int:
        """The fast kernel's weights, then TOP weight rows per row (not the table a second time)."""
        q, scale = self.weight.q, self.weight.scale
        per_weight_row = q.shape[1] * q.element_size() + scale[0].numel() * scale.element_size()
        return self.fast.streamed_bytes(rows) + rows * min(self.TOP, q.shape[0]) * per_weight_row


def lm_head_candidates(weight: Int8Weight, device: torch.device, dtype: torch.dtype) -> list[Kernel]:
    """The LM head's candidates: every coarse kernel (bf16, int8 activations) gets its top logits made
    exact (from the weight as given: a GGUF Q8_0 table keeps its per-block scales). A precise kernel
    (int8x2: logits within ~1e-4) needs no such pass: it would cost a topk over the vocabulary per row."""
    return [k if k.precise else ExactTopLogits(k, weight) for k in candidates(weight, device, dtype)]


class Int4PackCUDA(Kernel):
    name = "int4pack-cuda"
    exact = precise = False

    def __init__(self, weight: Int4Weight, device: torch.device):
        _, k = weight.shape
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        q = weight.q.to(device)
        nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        self.weight = torch._convert_weight_to_int4pack(nibbles.contiguous(), inner_k_tiles)
        self.scales_zeros = (
            torch.stack([weight.scale, weight.zero], -1).transpose(0, 1).contiguous().to(device, torch.bfloat16)
        )
        self.group_size = weight.group_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm(x.to(torch.bfloat16), self.weight, self.group_size, self.scales_zeros)
        return y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales_zeros]


class Dequant(Kernel):
    """Dequantize on every call, then matmul: the universal, exact path (and CUDA's int8 path)."""

    name = "dequant"

    def __init__(self, weight: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        n, k = weight.shape
        self.groups = (n, k // weight.group_size, weight.group_size)
        self.q = weight.q.to(device)
        self.scale = weight.scale.to(device, dtype)[..., None]
        self.zero = weight.zero.to(device, dtype)[..., None] if isinstance(weight, Int4Weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q.view(self.groups).to(x.dtype)
        w = q * self.scale if self.zero is None else (q - 8) * self.scale + self.zero
        return F.linear(x, w.view(self.groups[0], -1))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.q, self.scale, self.zero) if t is not None]


def candidates(weight: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> list[Kernel]:
    """Every path that can run this weight on this device, fastest-to-try first."""
    if device.type == "cuda" and not isinstance(weight, KQuantWeight):
        if isinstance(weight, Int4Weight) and weight.shape[0] % 8 == 0 and weight.shape[1] % 32 == 0:
            return [Int4PackCUDA(weight, device), Dequant(weight, device, dtype)]
        return [Dequant(weight, device, dtype)]
    if isinstance(weight, KQuantWeight):
        if device.type == "cpu" and _native_fits(weight):
            packed = pack_kquant(weight)  # one copy for every activation precision
            return [KQuantNative(packed, weight.shape[0], acts) for acts in NATIVE_ACTS]
        return [KQuantDequant(weight, device, dtype)]
    acts = [torch.bfloat16, torch.float32] if dtype == torch.float32 else [dtype]
    native_ok = _native_fits(weight)
    if native_ok and isinstance(weight, Int8Weight):
        scale = _native_int8_scales(weight)
        native_ok = scale is not None
    if isinstance(weight, Int4Weight):
        pack = functools.cache(functools.partial(_Int4Pack, weight))  # one copy for both activation dtypes
        own = [Int4Native(weight.packed, acts) for acts in NATIVE_ACTS] if native_ok else []
        return own + [Int4PackCPU(pack, a) for a in acts]
    own = [Int8Native(weight.q, scale, acts) for acts in NATIVE_ACTS] if native_ok else []
    # torch's int8 kernels take one scale per row: a grouped weight re-rounds
    per_channel = functools.cache(functools.partial(to_per_channel, weight))
    return own + [Int8PackCPU(per_channel, a) for a in acts]


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


__all__ = [
    "Kernel",
    "Int4PackCPU",
    "Int8PackCPU",
    "Int4Native",
    "Int8Native",
    "KQuantNative",
    "KQuantDequant",
    "Int4PackCUDA",
    "Dequant",
    "ExactTopLogits",
    "candidates",
    "lm_head_candidates",
]
