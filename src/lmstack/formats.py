"""Weight formats (how projection matrices are stored) and numeric profiles (the arithmetic).

Storage is not arithmetic: the default profile, fp32, computes in float32 whatever the format, its
bfloat16 and int8 weights widened inside the matmul; under it the embedding table, the norms and the
head are float32. bf16 is the explicit fast-arithmetic choice: activations, embedding and head in bfloat16.

| weight_format | bytes/weight | profiles  | matmul on CPU, fp32 (few rows / many rows)  | bf16 (few rows)          |
|---------------|--------------|-----------|---------------------------------------------|--------------------------|
| float32       | 4            | fp32      | kernels.matvec_f32 / F.linear               | -                        |
| bfloat16      | 2            | fp32, bf16| kernels.matvec_f32 / F.linear on widened w  | kernels.matvec_bf16_tiled|
| int8          | 1            | fp32, bf16| kernels.matvec_int8 / dequantized F.linear  | kernels.matvec_int8      |
| int4          | 0.5          | fp32, bf16| torch._weight_int4pack_mm_for_cpu / dequant.| the same                 |
| gguf          | as the file  | fp32, bf16| kernels.gguf_matvec / F.linear, dequantized | kernels.gguf_matvec      |

gguf keeps a GGUF file's tensors as stored (CPU only): the blocks of every type in kernels.GGUF_TYPES (Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q2_K..Q6_K) grouped by tiles of rows, BF16 as bfloat16, F32 and F16 as float32 (widened exactly);
any other type is refused at load (gguf.GGUFFile.check_as_stored). A BF16 matrix stays in the file's pages (a
read-only mapping, model.py's `mmap`) unless its rows need reordering (q and k) or the load asks for the kernels'
tiles. The embedding keeps its blocks too (the looked-up rows are dequantized) and a tied head multiplies them. A
fused projection whose parts differ in type computes each part as its type and concatenates. The arithmetic of
the blocks, per profile:
  fp32: each weight dequantized exactly as gguf.quants.dequantize does (e.g. (d * sc) * q - dmin * m in float32),
        multiplied with float32 x and summed in float32; for many rows (prefill) a float32 GEMM on them: without
        AMX, lmstack's (kernels.gguf_gemm: a panel dequantized at a time, in cache; PyTorch's float32 F.linear, MKL's,
        ran 2.5-3x slower on an AMD EPYC), with AMX F.linear on chunks of rows dequantized.
  bf16: llama.cpp's arithmetic on a few rows: x quantized to int8 as llama.cpp does for the type's dot product
        (per 256 columns as its Q8_K for the K-quants, per 32 columns, q = rint(x * 127 / amax) with the float32
        scale amax / 127, for the others), each block's sub-block integer dot products summed exactly
        (AVX512-VNNI), times the scales, summed in float32. Without AMX every row count (a prefill too) takes
        this arithmetic: its integer dot products beat a bfloat16 GEMM on the dequantized weights at any size; with
        AMX many rows take oneDNN's bfloat16 GEMM (F.linear, on chunks of rows dequantized and rounded).

int8 is symmetric per output channel; int4 is asymmetric per group of 32 inputs (llama.cpp's Q4_1
layout, PyTorch's packed CPU kernel); their scales are bfloat16 values in either profile, so the stored
weights do not depend on the profile. Only the projection matrices of each block are re-stored (each expert's
of a mixture too; its router stays in the arithmetic's dtype). The embedding and head take the arithmetic's dtype,
but under fp32 keep a checkpoint's BF16 as bfloat16 where lmstack's kernels run (model.py: widened where used). Where
lmstack's kernels cannot run (kernels.py): float32 is F.linear (oneDNN's packed float32 is faster for one
row, and 2-3x further from a float64 run on real weights), bfloat16 in bf16 oneDNN-packed, in fp32 widened
per call; int8 few-row products use torch._weight_int8pack_mm (bf16) or dequantize per call (fp32).
Off CPU, F.linear multiplies, bfloat16 weights widened per call under fp32.
"""

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import UnsupportedModel

NUMERIC_PROFILES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_PROFILE = "fp32"
PROFILES_OF = {"float32": ("fp32",), "bfloat16": ("fp32", "bf16"), "int8": ("fp32", "bf16"), "int4": ("fp32", "bf16"),
               "gguf": ("fp32", "bf16")}
WEIGHT_FORMATS = tuple(PROFILES_OF)
QUANTIZED = ("int8", "int4")
INT4_GROUP = 32
INT8_KERNEL_ROWS = 16  # up to this many rows the few-row int8 kernels beat a dequantized matmul on CPU
# and, where lmstack's GEMMs serve prefill (kernels.gemm_for_prefill), in bfloat16 3x F.linear at 1.7B's shapes at
# 16-32 rows, even at 135M's (F.linear waits for the tiles untiled)
INT8_BESIDE_GEMM = {torch.bfloat16: 32}
GGUF_KERNEL_ROWS = 16  # and the GGUF block kernels
# and beat lmstack's GEMM on the blocks (kernels.gemm_for_prefill): the bf16 profile's integer dot products at every
# row count (1.7B's Q4_K, Q6_K, Q8_0, Q4_0 and Q5_0 on an AMD EPYC: 1.8x at 64 rows, 1.1-1.3x at 512, 1.0-1.3x at
# 2048: VNNI multiplies twice the values of a bfloat16 dot product an instruction), float32's exact weights up to 48
# (1.1-1.5x at 16-48)
GGUF_BESIDE_GEMM = {torch.bfloat16: math.inf, torch.float32: 48}
GGUF_DENSE_BYTES = 4 << 20  # over GGUF_KERNEL_ROWS, the bytes of weights dequantized for one F.linear (the
# heap keeps a few freed pieces, which add to a prefill's peak: small ones, the GEMM as fast)
INT4_KERNEL_ROWS = 16  # and PyTorch's int4 kernel (over them, the weights dequantized for one GEMM)
MATVEC_ROWS = 8  # and lmstack's float32 and bfloat16 kernels beat F.linear
# and the kernels on bfloat16 weights (tiled, or rows as they are) beat lmstack's GEMM on them
# (kernels.gemm_for_prefill; 1.7B's shapes on an AMD EPYC, tiles: bfloat16 at 16 rows 1.5-2x, at 32 1.1-1.4x, even
# at 64; float32 at 16 1.3x, even at 24-32)
BF16_WEIGHTS_BESIDE_GEMM = {torch.bfloat16: 32, torch.float32: 24}


def few_rows(x: torch.Tensor, rows: int, beside_gemm: dict) -> float:
    """Rows of x up to which a module's few-row kernels take it: `rows`, or, where lmstack's GEMMs serve prefill
    (kernels.gemm_for_prefill: no AMX), the crossover against them for x's dtype in `beside_gemm`."""
    return beside_gemm.get(x.dtype, rows) if kernels.gemm_for_prefill() else rows


_ROW_INVARIANT = threading.local()


@contextmanager
def row_invariant():
    """Within it (in this thread), matmuls take lmstack's kernels (where they run) whatever the number of rows, so
    a row's arithmetic never depends on how many rows share the call: F.linear picks its kernel by shape."""
    previous = getattr(_ROW_INVARIANT, "on", False)
    _ROW_INVARIANT.on = True
    try:
        yield
    finally:
        _ROW_INVARIANT.on = previous


def row_invariant_active() -> bool:
    """Whether this thread is within row_invariant()."""
    return getattr(_ROW_INVARIANT, "on", False)


# row_invariant of a module whose matmul, where lmstack's kernels run (its `kernel`), takes them for any number of rows
_KERNEL_ROW_INVARIANT = property(lambda self: self.kernel, doc="whether each row's result is the same whatever the "
                                 "rows beside it, under row_invariant()")


@dataclass(frozen=True)
class KernelCall:
    """The one kernel a projection module calls for a few rows (kernels_layer.cpp's Projection): its kind, its
    tensors, the bias summed inside the kernel (`bias`) or added after it (`bias_after`)."""

    kind: str  # bf16_tiled, bf16, f32, int8, gguf, int4; or cat: the parts' outputs concatenated
    weight: torch.Tensor | None
    scales: torch.Tensor | None = None
    n: int = 0
    qtype: int = 0
    bias: torch.Tensor | None = None
    bias_after: torch.Tensor | None = None
    parts: tuple = ()  # cat's KernelCalls


def resolve(weight_format: str, numeric_profile: str | None) -> torch.dtype:
    """The compute dtype for a (format, profile) pair; unknown or unsupported pairs are refused by name."""
    if weight_format not in PROFILES_OF:
        raise ValueError(f"weight_format {weight_format!r} is not one of {', '.join(PROFILES_OF)}")
    profile = DEFAULT_PROFILE if numeric_profile is None else numeric_profile
    if profile not in NUMERIC_PROFILES:
        raise ValueError(f"numeric_profile {profile!r} is not one of {', '.join(NUMERIC_PROFILES)}")
    if profile not in PROFILES_OF[weight_format]:
        raise ValueError(f"numeric_profile {profile!r} is not available with weight_format {weight_format!r} "
                         f"(available: {', '.join(PROFILES_OF[weight_format])})")
    return NUMERIC_PROFILES[profile]


def profile_of(dtype: torch.dtype) -> str:
    """The numeric profile that computes in dtype."""
    return next(name for name, d in NUMERIC_PROFILES.items() if d == dtype)


def check_format(weight_format: str, plan, devices=()):
    """Refuse, before any weight is read, a format the plan's kind or matrix widths cannot take."""
    if weight_format == "int4" and plan.kind != "transformer":
        raise UnsupportedModel(f"weight_format 'int4' is not available for {plan.kind} models "
                               f"(model_type {plan.model_type!r}); use float32, bfloat16 or int8")
    if weight_format in ("int4", "gguf") and any(d.type not in ("cpu", "meta") for d in devices):
        raise ValueError(f"weight_format {weight_format!r} runs on CPU only")
    if weight_format == "int4":
        o = plan.block_options
        widths = {"hidden_size": plan.d_model, "intermediate_size": o["d_ff"],
                  "heads * head_dim": o["n_heads"] * o["head_dim"]}
        if any(plan.layer_experts):
            widths["the experts' intermediate size"] = o["experts"]["d_ff"]
        for name, width in widths.items():
            if width % INT4_GROUP:
                raise ValueError(f"weight_format 'int4' needs {name} divisible by {INT4_GROUP}, got {width}")


class PackedLinear(nn.Module):
    """Weights reordered once into oneDNN's blocked layout (what torch.compile's CPU backend does).

    For bfloat16 arithmetic on CPUs without lmstack's kernels: it reads bfloat16 weights two to three times
    faster than F.linear for one row (decode) and is no slower for many (prefill).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x):
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        return self.weight.to_dense()


class Int8Linear(nn.Module):
    """Symmetric per-output-channel int8: w ~= q * scale, |q| <= 127.

    With lmstack's kernels q is stored tiled (kernels.tile_int8), else as the (out, in) matrix.
    """

    def __init__(self, linear: nn.Linear, compute: torch.dtype):
        super().__init__()
        w = linear.weight.detach().float()
        self.shape = tuple(w.shape)
        # rounded to bfloat16 first (in either profile, so storage does not depend on the arithmetic), so
        # each weight lands within half a step of the stored scale
        absmax = torch.maximum(w.amax(dim=1), -w.amin(dim=1))
        self.scales = (absmax / 127).clamp(min=torch.finfo(torch.bfloat16).tiny).bfloat16().float()
        q = w / self.scales[:, None]  # the one full-size temporary: a load stays lean
        q = q.round_().clamp_(-127, 127).to(torch.int8)
        self.bias = None if linear.bias is None else linear.bias.detach().to(compute)
        on_cpu = q.device.type == "cpu"
        self.kernel = on_cpu and kernels.available()
        self.packed_kernel = on_cpu and compute == torch.bfloat16 and not self.kernel  # PyTorch's, else
        self.weight = kernels.tile_int8(q) if self.kernel else q

    row_invariant = _KERNEL_ROW_INVARIANT

    def forward(self, x):
        rows = x.numel() // x.shape[-1]
        if self.kernel and (rows <= few_rows(x, INT8_KERNEL_ROWS, INT8_BESIDE_GEMM) or row_invariant_active()):
            return kernels.matvec_int8(x, self.weight, self.scales, self.bias)
        if self.packed_kernel and rows <= INT8_KERNEL_ROWS:
            y = torch._weight_int8pack_mm(x.reshape(rows, -1), self.weight, self.scales.to(x.dtype))
            y = y.view(*x.shape[:-1], -1)
        elif self.kernel and x.dtype == torch.float32 and kernels.gemm_for_prefill():  # many rows (a prefill)
            return kernels.gemm_f32_int8_tiled(x, self.weight, self.scales, self.bias)
        else:  # many rows: dequantizing once for a dense matmul beats the few-row kernels
            y = F.linear(x, self._matrix(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _matrix(self, dtype: torch.dtype) -> torch.Tensor:
        return kernels.untile_int8(self.weight, *self.shape, dtype) if self.kernel else self.weight.to(dtype)

    def kernel_call(self, dtype: torch.dtype) -> KernelCall | None:
        """What forward computes a few rows of dtype with (None where it is not one of lmstack's kernels)."""
        return KernelCall("int8", self.weight, self.scales, bias=self.bias) if self.kernel else None

    def dense_weight(self) -> torch.Tensor:
        return self._matrix(torch.float32) * self.scales[:, None]


class Int4Linear(nn.Module):
    """Asymmetric int4 in groups of INT4_GROUP inputs: w ~= (q - 8) * scale + zero, 0 <= q <= 15."""

    def __init__(self, linear: nn.Linear, compute: torch.dtype):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-6).bfloat16().float()  # the kernel's dtype, before rounding
        zero = (low + 8 * scale).bfloat16().float()
        q = (groups - zero).div_(scale).add_(8).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
        self.weight = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_zeros = torch.stack([scale.reshape(n, -1), zero.reshape(n, -1)], -1).transpose(0, 1)
        self.scales_zeros = self.scales_zeros.contiguous().to(compute)  # bfloat16 values: exact in float32
        self.bias = None if linear.bias is None else linear.bias.detach().to(compute)
        self.in_features, self.out_features = k, n
        self.dequantizes = kernels.available() and self._dequantized_matches()

    row_invariant = True  # PyTorch's int4 CPU kernel sums each row alike whatever the rows (tests/test_lookup.py)

    def dense_weight(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype, device=self.weight.device)
        return self._matmul(eye).float().T  # what the kernel computes with, column by column

    def _matmul(self, x):
        return torch._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scales_zeros)

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights transposed, (in, out), dequantized in dtype from PyTorch's packed layout (kernels_int4.cpp)."""
        return kernels.int4pack_dequantize_t(self.weight, self.scales_zeros, self.out_features, self.in_features,
                                             dtype)

    def _dequantized_matches(self) -> bool:
        """Whether kernels_int4.cpp reads this PyTorch's packed layout (no public contract): its values in the
        first and last 32 columns against PyTorch's own kernel times those unit vectors, to one bfloat16 step."""
        k = self.in_features
        columns = torch.cat([torch.arange(INT4_GROUP), torch.arange(k - INT4_GROUP, k)]).unique()
        unit = torch.eye(k, dtype=self.scales_zeros.dtype, device=self.weight.device)[columns]
        theirs = self._matmul(unit).float()
        ours = self._dequantized(self.scales_zeros.dtype)[columns].float()
        return torch.allclose(ours, theirs, rtol=2 ** -7, atol=1e-6 * float(theirs.abs().max()))

    def kernel_call(self, dtype: torch.dtype) -> KernelCall:
        return KernelCall("int4", self.weight, self.scales_zeros, bias_after=self.bias)

    def forward(self, x):
        """PyTorch's int4 kernel on a few rows; on many (a prefill), the weights dequantized in x's dtype for one
        GEMM (oneDNN's, on AMX where the CPU has it), which reads them once instead of once a row; in float32 where
        kernels.gemm_for_prefill, lmstack's GEMM, dequantizing a panel at a time (MKL's ran at a third of its rate
        on an AMD EPYC)."""
        if self.dequantizes and x.numel() > INT4_KERNEL_ROWS * self.in_features and not row_invariant_active():
            if x.dtype == torch.float32 and self.out_features % 64 == 0 and kernels.gemm_for_prefill():
                return kernels.gemm_f32_int4pack(x, self.weight, self.scales_zeros, self.out_features, self.bias)
            y = x @ self._dequantized(x.dtype)
        else:
            y = self._matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class MatvecLinear(nn.Module):
    """A float32 or bfloat16 matrix: lmstack's kernels for a few rows (decode), F.linear for more (prefill). Under
    float32 activations bfloat16 weights are widened, exactly, and multiplied in float32. A bfloat16 matrix is
    stored tiled (kernels.tile_int8), which the kernels read faster, unless `tile` is False (a tied head, which
    shares the embedding's memory; a GGUF's BF16 matrix in the file's mapping); many rows then take
    kernels.gemm_bf16_tiled or gemm_f32_tiled (where kernels.gemm_for_prefill), which read the tiles as stored:
    F.linear needs them untiled, a copy of every weight per call. An untiled matrix takes kernels.gemm_f32_rows
    there (MKL's float32 F.linear ran at half its rate on an AMD EPYC) or, bfloat16 in bfloat16, gemm_bf16_rows
    (a 1.7B model's prefill 1.04x faster than on oneDNN's F.linear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute: torch.dtype, tile: bool = True):
        super().__init__()
        self.shape = tuple(weight.shape)
        self.bias = None if bias is None else bias.detach().to(compute)
        self.kernel = weight.is_cpu and kernels.available()
        self.tiled = tile and self.kernel and weight.dtype == torch.bfloat16
        self.weight = kernels.tile_int8(weight.detach()) if self.tiled else weight.detach()

    @classmethod
    def from_tiles(cls, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None,
                   compute: torch.dtype = torch.bfloat16) -> "MatvecLinear":
        """An (n, k) bfloat16 matrix already in kernels.tile_int8's tiles, as the bytes read_pack_gguf packed them
        (kernels.packed_shape(kernels.BF16, n, k); read from a file, model.py)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        tiles = packed.view(torch.bfloat16).view(-1, k // 32, kernels.TILE, 32)
        linear.shape, linear.kernel, linear.tiled, linear.weight = (n, k), True, True, tiles
        linear.bias = None if bias is None else bias.detach().to(compute)
        return linear

    row_invariant = _KERNEL_ROW_INVARIANT

    def forward(self, x):
        rows = few_rows(x, MATVEC_ROWS, BF16_WEIGHTS_BESIDE_GEMM if self.weight.dtype == torch.bfloat16 else {})
        if self.kernel and (x.numel() <= rows * self.shape[1] or row_invariant_active()):
            if x.dtype == torch.float32:
                if self.tiled:
                    return kernels.matvec_f32_tiled(x, self.weight, self.shape[0], self.bias)
                return kernels.matvec_f32(x, self.weight, self.bias)
            if self.tiled:
                return kernels.matvec_bf16_tiled(x, self.weight, self.shape[0], self.bias)
            return kernels.matvec_bf16(x, self.weight, self.bias)
        if self.kernel and kernels.gemm_for_prefill():
            if self.tiled and x.dtype == torch.float32:
                return kernels.gemm_f32_tiled(x, self.weight, self.shape[0], self.bias)
            if self.tiled and x.dtype == torch.bfloat16 and self.shape[1] % 2 == 0:
                return kernels.gemm_bf16_tiled(x, self.weight, self.shape[0], self.bias)
            if x.dtype == torch.float32 and not self.tiled:
                return kernels.gemm_f32_rows(x, self.weight, self.bias)
            if x.dtype == self.weight.dtype == torch.bfloat16 and not self.tiled and self.shape[1] % 2 == 0:
                return kernels.gemm_bf16_rows(x, self.weight, self.bias)
        return F.linear(x, self.dense_weight(x.dtype), self.bias)

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.tiled:
            return kernels.untile_int8(self.weight, *self.shape, dtype)
        return self.weight if dtype is None else self.weight.to(dtype)

    def kernel_call(self, dtype: torch.dtype) -> KernelCall | None:
        if not self.kernel or (dtype == torch.bfloat16 and self.weight.dtype != dtype):
            return None
        kind = ("f32" if dtype == torch.float32 else "bf16") + ("_tiled" if self.tiled else "")
        return KernelCall(kind, self.weight, n=self.shape[0], bias=self.bias)


def _fast_cpu_linear(linear: nn.Linear, tile: bool = True) -> nn.Module:
    """A float32 or bfloat16 matrix, computed in its own dtype, in its fastest exact form (F.linear off CPU)."""
    weight = linear.weight
    if weight.is_cpu and weight.dtype == torch.bfloat16 and not kernels.available() and \
            torch.backends.mkldnn.is_available():
        return PackedLinear(linear)
    return MatvecLinear(weight, linear.bias, weight.dtype, tile)  # float32 never oneDNN-packed: it is less accurate


def convert(linear: nn.Linear, weight_format: str, compute: torch.dtype) -> nn.Module:
    """The module that runs `linear` (filled in float32, or in bfloat16 when both format and arithmetic are)
    stored in `weight_format`, computing in `compute`."""
    if weight_format == "int8":
        return Int8Linear(linear, compute)
    if weight_format == "int4":
        return Int4Linear(linear, compute)  # check_format made sure of the device and the widths
    if weight_format == "bfloat16" and compute == torch.float32:
        return MatvecLinear(linear.weight.to(torch.bfloat16), linear.bias, compute)
    return _fast_cpu_linear(linear)


def head_projection(weight: torch.Tensor, tied: bool) -> nn.Module:
    """The head's matmul in its fastest form, in the weight's dtype; on CPU without lmstack's kernels a tied
    bfloat16 head is a packed copy. A tied head is not tiled: it would be a second copy of the embedding."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return _fast_cpu_linear(linear, tile=not tied)


class GGUFBlocks(nn.Module):
    """One GGUF tensor's blocks as stored (a type of kernels.GGUF_TYPES), grouped by tiles of rows
    (kernels.pack_gguf)."""

    def __init__(self, raw: torch.Tensor, qtype: int, k: int):
        super().__init__()
        self.weight = kernels.pack_gguf(raw, qtype)
        self.qtype, self.n, self.k = qtype, raw.shape[0], k
        self.kernel = kernels.available()

    @classmethod
    def from_packed(cls, packed: torch.Tensor, qtype: int, n: int, k: int) -> "GGUFBlocks":
        """Blocks pack_gguf already packed, e.g. a large tensor packed a chunk of rows at a time (model.py)."""
        blocks = cls.__new__(cls)
        nn.Module.__init__(blocks)
        blocks.weight, blocks.qtype, blocks.n, blocks.k = packed, qtype, n, k
        blocks.kernel = kernels.available()
        return blocks

    row_invariant = _KERNEL_ROW_INVARIANT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T in x's dtype: lmstack's block kernels on a few rows (GGUF_KERNEL_ROWS, or GGUF_BESIDE_GEMM
        beside lmstack's GEMM: any number of bfloat16 rows); on many (a prefill), a GEMM on the weights dequantized
        in x's dtype (exactly in float32, rounded in bfloat16): float32 a panel at a time inside kernels.gguf_gemm
        where kernels.gemm_for_prefill, else a chunk of rows at a time for F.linear."""
        if self.kernel and (x.numel() <= few_rows(x, GGUF_KERNEL_ROWS, GGUF_BESIDE_GEMM) * self.k or
                            row_invariant_active()):
            return kernels.gguf_matvec(x, self.weight, self.qtype, self.n, None)
        if self.kernel and x.dtype == torch.float32 and kernels.gemm_for_prefill():
            return kernels.gguf_gemm(x, self.weight, self.qtype, self.n, None)
        tile = kernels.GGUF_TYPES[self.qtype].tile
        step = max(tile, GGUF_DENSE_BYTES // (self.k * x.element_size()) // tile * tile)
        if not self.kernel or step >= self.n:
            return F.linear(x, self.dense(dtype=x.dtype))
        # whole tiles of rows at a time: the whole matrix dequantized (a tied head's vocab x d_model) would take
        # several times the blocks' memory
        return torch.cat([F.linear(x, kernels.gguf_dequantize(self.weight[r // tile:(r + step) // tile], self.qtype,
                                                              min(step, self.n - r), self.k, None, x.dtype))
                          for r in range(0, self.n, step)], dim=-1)

    def dense(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights (or rows of them) as float32, bit-equal to gguf.quants.dequantize (or those values rounded
        to bfloat16)."""
        return kernels.gguf_dequantize(self.weight, self.qtype, self.n, self.k, rows, dtype)

    def kernel_call(self, dtype: torch.dtype) -> KernelCall | None:
        return KernelCall("gguf", self.weight, n=self.n, qtype=self.qtype) if self.kernel else None

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dense(ids).to(dtype)

    def dense_weight(self) -> torch.Tensor:
        return self.dense()


class GGUFLinear(nn.Module):
    """A projection whose parts (q, k and v; gate and up; the head) stay as their GGUF tensors store them: blocks
    (GGUFBlocks) or float32 and bfloat16 tensors (exact). The parts' outputs are concatenated."""

    def __init__(self, parts: list, bias: torch.Tensor | None, compute: torch.dtype, tile: bool = True):
        super().__init__()
        self.parts = nn.ModuleList(  # bfloat16 ones tiled, but not a tied head (the embedding)
            p if isinstance(p, (GGUFBlocks, MatvecLinear)) else MatvecLinear(p, None, p.dtype, tile) for p in parts)
        self.bias = None if bias is None else bias.detach().to(compute)

    @property
    def row_invariant(self) -> bool:
        """Whether each row's result is the same whatever the rows beside it, under row_invariant()."""
        return all(p.row_invariant for p in self.parts)

    def _part(self, part, x):
        if part.weight.dtype == torch.float32 and x.dtype != torch.float32:  # widened: float32 weights stay exact
            return part(x.float()).to(x.dtype)
        return part(x)

    def kernel_call(self, dtype: torch.dtype) -> KernelCall | None:
        """One part's kernel, or "cat" of the parts' (q and k in Q4_K, v in Q6_K: a Q4_K_M file's mix)."""
        calls = [p.kernel_call(dtype) for p in self.parts]  # (None for a float32 part _part widens x for)
        if any(c is None for c in calls):
            return None
        if len(calls) == 1:
            return replace(calls[0], bias_after=self.bias)
        return KernelCall("cat", None, bias_after=self.bias, parts=tuple(calls))

    def forward(self, x):
        ys = [self._part(part, x) for part in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        return torch.cat([p.dense_weight().float() for p in self.parts])
