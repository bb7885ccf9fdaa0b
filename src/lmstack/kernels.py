"""lmstack's own CPU kernels (kernels.cpp), for decoding on x86 CPUs with AVX512-BF16.

Decoding one token reads every weight once, through many small operators. For one row of input
PyTorch's CPU kernels read weights at 25-35 GB/s (oneDNN's packed bfloat16, torch._weight_int8pack_mm),
well under what the memory delivers, and eager PyTorch spends ~15 us on an RMSNorm of one row and ~30 us
on rotary embedding, cache writes and attention per layer. kernels.cpp does each in one call: matvec for
bfloat16 (tiled) and int8 weights; RMSNorm, rotary with the cache write, one-query attention and silu(gate) * up
for float32 and bfloat16 activations (bench/decode.py shows the whole-model effect). Results differ from
PyTorch's operators only in float32 summation order and exp's last bit (tests/test_kernels.py).

It is compiled on first use with torch.utils.cpp_extension (a few seconds, then cached, and loaded as it is
while its sources are unchanged). Without a compiler, on other CPUs, or with LMSTACK_KERNELS=0, the callers use
PyTorch's operators instead.
"""

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

NAME = "lmstack_kernels"
STALE_LOCK_SECONDS = 600
TILE = 8  # rows of w per tile: kernels.cpp's TILE
REGROUPED_TILE = 16  # rows of w per record of the regrouped GGUF types (Q8_0, Q4_0, ...): kernels.h's
FLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mf16c",
         "-mfma", "-mgfni", "-fopenmp"]
SOURCES = ("kernels.cpp", "kernels_gguf.cpp", "kernels_layer.cpp", "kernels_int4.cpp", "kernels_gemm.cpp",
           "kernels_pack.cpp", "kernels_prefill_attention.cpp")
ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
# what FLAGS let the compiler use
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c", "fma", "gfni"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as Linux lists them (none where /proc cannot be read); read once, since a prefill
    asks for them at every projection (gemm_for_prefill) and a read of /proc/cpuinfo takes about 50 us."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def remove_stale_lock(lock: Path):
    """PyTorch waits forever on the lock of a build that was killed halfway; a build takes well under a minute, so a
    lock older than STALE_LOCK_SECONDS is such a leftover."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"removing {lock}, left by a kernels build that stopped {age / 60:.0f} minutes ago", stacklevel=3)
        lock.unlink(missing_ok=True)


def fingerprint() -> str:
    """What a build is made from: the sources (with kernels.h) and the flags."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for name in (*SOURCES, "kernels.h"):
        digest.update(Path(__file__).with_name(name).read_bytes())
    return digest.hexdigest()


def build_directory() -> Path:
    """Where the kernels are built and cached: per Python and PyTorch version, under torch's extensions root."""
    from torch import _appdirs  # as torch.utils.cpp_extension.get_default_build_root finds it

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
    return Path(root) / f"{NAME}-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"


@functools.cache
def available() -> bool:
    """Whether this CPU can run the kernels and they are built (once per machine, on first call).

    A build whose fingerprint file matches the sources is loaded as it is: torch's cpp_extension.load, which
    imports setuptools and runs ninja to find nothing to do, took a tenth of a second of every start."""
    if os.environ.get("LMSTACK_KERNELS", "1") == "0":
        return False
    if sys.platform != "linux" or platform.machine() != "x86_64" or not CPU_FLAGS <= cpu_flags():
        return False
    try:
        build, made_from = build_directory(), fingerprint()
        library, stamp = build / f"{NAME}.so", build / "fingerprint"
        if library.exists() and stamp.exists() and stamp.read_text() == made_from:
            torch.ops.load_library(str(library))
            return True
        from torch.utils import cpp_extension

        build.mkdir(parents=True, exist_ok=True)
        remove_stale_lock(build / "lock")
        cpp_extension.load(name=NAME, sources=[str(Path(__file__).with_name(s)) for s in SOURCES], extra_cflags=FLAGS,
                           build_directory=str(build), is_python_module=False)
        stamp.write_text(made_from)
    except Exception as error:  # no compiler or ninja, or an old PyTorch: PyTorch's operators still work
        warnings.warn(f"lmstack's CPU kernels could not be built, using PyTorch's operators: {error}", stacklevel=2)
        return False
    return True


def loaded() -> bool:
    """Whether available() has loaded the kernels in this process: a caller that can do without them (a file's
    read) does not start their build. Asked again each time, since the answer turns true once they load."""
    return available.cache_info().currsize > 0 and available()


def gemm_for_prefill() -> bool:
    """Whether a bfloat16 prefill takes kernels_gemm.cpp's GEMM on the weights as stored: with AVX512-BF16 alone it
    matches oneDNN's GEMM and spares the dense copy F.linear needs; with AMX (amx_bf16) oneDNN's GEMM is several
    times faster than either, copy and all."""
    return available() and "amx_bf16" not in cpu_flags()


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels for activations (RMSNorm, rotary, attention, silu * up) take x."""
    return x.dtype in ACTIVATION_DTYPES and x.is_cpu and available()


def matvec_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for a few rows of x (decode, small batches), all bfloat16, weight (N, K) as it is
    (a tied head, which shares the embedding's memory)."""
    return torch.ops.lmstack.matvec_bf16(x, weight, bias)


def matvec_bf16_tiled(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias for w = untile_int8(weight, n, K), all bfloat16: the tiles are read as one stream, faster
    than matvec_bf16 reads rows. Each row's result does not depend on how many rows share the call."""
    return torch.ops.lmstack.matvec_bf16_tiled(x, weight, n, bias)


def gemm_bf16_tiled(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias for many rows of bfloat16 x (a prefill), w = untile_int8(weight, n, K): one GEMM on the tiles
    as stored, without the dense copy F.linear would need (kernels_gemm.cpp). K must be even."""
    return torch.ops.lmstack.gemm_bf16_tiled(x, weight, n, bias)


def gemm_f32_tiled(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias for many rows of float32 x, w = untile_int8(weight, n, K) widened exactly: gemm_bf16_tiled's
    GEMM in float32, each block of 256 columns summed apart and added, as a float32 BLAS sums them."""
    return torch.ops.lmstack.gemm_f32_tiled(x, weight, n, bias)


def gemm_f32_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for many rows of float32 x and a float32 or bfloat16 (widened exactly) weight as it is
    (a tied head, which shares the embedding's memory): gemm_f32_tiled's GEMM, each panel of rows transposed into
    cache as it is read."""
    return torch.ops.lmstack.gemm_f32_rows(x, weight, bias)


def gemm_bf16_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for many rows of bfloat16 x and a bfloat16 weight as it is (a GGUF's BF16 matrix in the
    file's mapping): gemm_bf16_tiled's GEMM, each panel of rows transposed into cache as it is read. K must be
    even."""
    return torch.ops.lmstack.gemm_bf16_rows(x, weight, bias)


def matvec_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for a few rows of float32 x, weight float32 or bfloat16 (widened exactly), summed
    in float64 for float32 weights (each output the exact result rounded about once, more accurately than a
    float32 GEMM), in float32 for bfloat16 ones (float64 would make them compute-bound)."""
    return torch.ops.lmstack.matvec_f32(x, weight, bias)


def matvec_f32_tiled(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """matvec_f32 for bfloat16 w = untile_int8(weight, n, K): the tiles read as one stream, the same sums."""
    return torch.ops.lmstack.matvec_f32_tiled(x, weight, n, bias)


def tile_int8(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 (or bfloat16) -> (ceil(N / TILE), ceil(K / 32), TILE, 32), zero-padded: the order matvec_int8
    (matvec_bf16_tiled) reads."""
    n, k = q.shape
    padded = F.pad(q, (0, -k % 32, 0, -n % TILE)) if k % 32 or n % TILE else q  # pad copies even when it adds nothing
    return padded.view(padded.shape[0] // TILE, TILE, padded.shape[1] // 32, 32).transpose(1, 2).contiguous()


def untile_int8(tiled: torch.Tensor, n: int, k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The (n, k) matrix tile_int8 stored, in `dtype` (widened in the one copy that untiles it)."""
    rows = tiled.transpose(1, 2)
    rows = rows.contiguous() if dtype in (None, tiled.dtype) else rows.to(dtype, memory_format=torch.contiguous_format)
    return rows.reshape(tiled.shape[0] * TILE, -1)[:n, :k]


def gemm_f32_int8_tiled(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """(x @ w.T) * scales + bias for many rows of float32 x, w = untile_int8(weight) widened exactly: the GEMM of
    gemm_f32_tiled on matvec_int8's weights."""
    return torch.ops.lmstack.gemm_f32_int8_tiled(x, weight, scales, bias)


def matvec_int8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """(x @ w.T) * scales + bias for w = untile_int8(weight) with float32 scales; x in
    bfloat16 or float32."""
    return torch.ops.lmstack.matvec_int8(x, weight, scales, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps), rounded to x's dtype) over the last dimension of x; x and
    weight of one dtype, float32 or bfloat16."""
    return torch.ops.lmstack.rms_norm(x, weight, eps)


def rope_into_cache(qkv, cos, sin, k_cache, v_cache, start: int) -> torch.Tensor:
    """Rotary on the q and k heads of qkv (B, L, H + 2 KV, D); k and v written into the caches at slots
    start..start+L-1; returns the rotated q heads (B, L, H, D)."""
    return torch.ops.lmstack.rope_into_cache(qkv, cos, sin, k_cache, v_cache, start)


def rope_into_pages(qkv, cos, sin, k_pool, v_pool, slots) -> torch.Tensor:
    """rope_into_cache for tokens of many sequences in one row (1, T, H + 2 KV, D): k and v go to pool slots
    `slots` (T,) of pools (blocks, KV, block_size, D); returns the rotated q heads (1, T, H, D)."""
    return torch.ops.lmstack.rope_into_pages(qkv, cos, sin, k_pool, v_pool, slots)


def decode_attention(q, k_cache, v_cache, length: int, scale: float | None = None) -> torch.Tensor:
    """One query per row, no mask: q (B, 1, H, D) over cache slots 0..length-1 -> (B, 1, H * D); scores scaled by
    `scale` (None: 1/sqrt(D))."""
    return torch.ops.lmstack.decode_attention(q, k_cache, v_cache, length, scale or 0.0)


def prefill_attention(q, k_cache, v_cache, start: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention of many queries, all bfloat16: q (B, L, H, D) at positions start..start+L-1 over cache
    slots 0..each one's position, caches (B, KV, T, D), D a multiple of 32; scores scaled by `scale` (None:
    1/sqrt(D)). Returns (B, L, H * D)."""
    return torch.ops.lmstack.prefill_attention(q, k_cache, v_cache, start, scale or 0.0)


def paged_attention(q, k_pool, v_pool, tables, seqs, positions, window: int,
                    scale: float | None = None) -> torch.Tensor:
    """Tokens of many sequences, each attending through its block table: q (T, H, D), pools (blocks, KV, size, D),
    tables (S, max_blocks), seqs and positions (T,) int64; window 0: no window; scores scaled by `scale` (None:
    1/sqrt(D)). Returns (T, H * D)."""
    return torch.ops.lmstack.paged_attention(q.contiguous(), k_pool, v_pool, tables, seqs, positions, window,
                                             scale or 0.0)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    return torch.ops.lmstack.silu_mul(gate_up)


def int4pack_dequantize_t(packed: torch.Tensor, scales_zeros: torch.Tensor, n: int, k: int, dtype: torch.dtype):
    """The (k, n) transposed weights of PyTorch's int4 packed layout, (q - 8) * scale + zero in dtype (float32, or
    those values rounded to bfloat16): for one GEMM over many rows (kernels_int4.cpp)."""
    return torch.ops.lmstack.int4pack_dequantize_t(packed, scales_zeros, n, k, dtype)


def gemm_f32_int4pack(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, n: int,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias for many rows of float32 x, w int4pack_dequantize_t's float32 values (transposed back), n a
    multiple of 64: the float32 GEMM of gemm_f32_tiled, dequantizing a panel at a time (kernels_int4.cpp)."""
    return torch.ops.lmstack.gemm_f32_int4pack(x, packed, scales_zeros, n, bias)


# ---- GGUF blocks as stored (kernels_gguf.cpp) ----------------------------------------------------


@dataclass(frozen=True)
class BlockType:
    """A GGUF block type the kernels multiply as stored, one row of kernels_gguf.cpp's TYPES: weights and bytes of
    a block, where its float16 scales lie (d, and dmin or m: each must be finite; side by side at the block's start
    or end), and whether pack_gguf regroups its fields by tiles of 16 rows (scales first, then Q5_0/Q5_1's fifth
    bits, then the block's other bytes) or keeps each block whole (Q2_K, Q3_K). The reference dequantization of
    every type is gguf.quants.dequantize."""

    name: str
    values: int
    bytes: int
    float16_at: tuple
    regrouped: bool = False

    @property
    def tile(self) -> int:
        """Rows of w per record of pack_gguf."""
        return REGROUPED_TILE if self.regrouped else TILE


GGUF_TYPES = {  # ggml type id -> its BlockType
    8: BlockType("Q8_0", 32, 34, (0,), regrouped=True),
    2: BlockType("Q4_0", 32, 18, (0,), regrouped=True),
    3: BlockType("Q4_1", 32, 20, (0, 2), regrouped=True),
    6: BlockType("Q5_0", 32, 22, (0,), regrouped=True),
    7: BlockType("Q5_1", 32, 24, (0, 2), regrouped=True),
    10: BlockType("Q2_K", 256, 84, (80, 82)),
    11: BlockType("Q3_K", 256, 110, (108,)),
    12: BlockType("Q4_K", 256, 144, (0, 2), regrouped=True),
    13: BlockType("Q5_K", 256, 176, (0, 2), regrouped=True),
    14: BlockType("Q6_K", 256, 210, (208,), regrouped=True),
}
Q8_0 = 8
BF16 = 30  # ggml's type id: not a block type, but its rows read as 64-byte blocks kept whole are tile_int8's tiles
BF16_TILES = BlockType("BF16", 32, 64, ())
FIFTH_BITS = (6, 7)  # Q5_0, Q5_1: 32 fifth bits after the float16 scales


def _fifth_bits(bits: torch.Tensor) -> torch.Tensor:
    """(.., 16, 4) bytes of Q5 fifth bits (bit c of row r: column c) -> (.., 64): for each group g of columns
    4g..4g+3, 64 bits, bit 4r + t the bit of row r's column 4g + t (kernels_gguf.cpp)."""
    nibbles = torch.stack([bits[..., g // 2] >> 4 * (g % 2) & 0x0F for g in range(8)], dim=-1)  # (.., row, group)
    pairs = nibbles.reshape(*bits.shape[:-2], 8, 2, 8)  # (.., row // 2, row % 2, group)
    return (pairs[..., 0, :] | pairs[..., 1, :] << 4).transpose(-1, -2).reshape(*bits.shape[:-2], 64)


def _fifth_bits_back(packed: torch.Tensor) -> torch.Tensor:
    """_fifth_bits' (.., 64) -> (.., 16, 4)."""
    groups = packed.reshape(*packed.shape[:-1], 8, 8).transpose(-1, -2)  # (.., row // 2, group)
    nibbles = torch.stack([groups & 0x0F, groups >> 4], dim=-2).reshape(*packed.shape[:-1], 16, 8)
    return nibbles[..., 0::2] | nibbles[..., 1::2] << 4


def _by_columns_of_four(quants: torch.Tensor, q8: bool) -> torch.Tensor:
    """(.., 16, bytes) quants of 16 rows -> (.., 16 * bytes): chunks of 64 bytes, chunk g holding bytes 4g..4g+3 of
    every row, row r at 4r (for the 32-weight types, 4 columns of the 16 rows); Q8_0's quants stored as q + 128
    (kernels_gguf.cpp)."""
    if q8:
        quants = (quants.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return quants.reshape(*quants.shape[:-1], -1, 4).transpose(-3, -2).reshape(*quants.shape[:-2], -1)


def _by_columns_of_four_back(packed: torch.Tensor, q8: bool) -> torch.Tensor:
    """_by_columns_of_four's (.., 16 * bytes) -> (.., 16, bytes)."""
    quants = packed.reshape(*packed.shape[:-1], -1, REGROUPED_TILE, 4).transpose(-3, -2)
    quants = quants.reshape(*packed.shape[:-1], REGROUPED_TILE, -1)
    return (quants.to(torch.int16) - 128).to(torch.int8).view(torch.uint8) if q8 else quants


def block_kind(qtype: int) -> BlockType:
    """GGUF_TYPES[qtype]; for BF16, its rows as read_pack_gguf reads them into tile_int8's tiles."""
    return BF16_TILES if qtype == BF16 else GGUF_TYPES[qtype]


def packed_shape(qtype: int, n: int, k: int) -> tuple:
    """The shape of pack_gguf's records for an (n, k) matrix of GGUF type qtype (BF16: tile_int8's, in bytes)."""
    kind = block_kind(qtype)
    return -(-n // kind.tile), k // kind.values, kind.tile * kind.bytes


def pack_gguf(raw: torch.Tensor, qtype: int, out: torch.Tensor | None = None, row: int = 0,
              n: int | None = None) -> torch.Tensor:
    """(N, K / values * block bytes) uint8, a GGUF tensor's rows as stored -> (ceil(N / tile), K / values, record
    bytes), tile = GGUF_TYPES[qtype].tile: for each tile of rows and column block, the rows' blocks side by side,
    or, for a regrouped type, the 16 rows' float16 scales field by field, [Q5_0/Q5_1's fifth bits,] then the
    rest of their blocks, 4 bytes of each of the 16 rows in each 64 bytes (the 32-weight types: 4 columns of the 16
    rows; kernels_gguf.cpp); padding rows are zeros. With `out`, the packing of an n-row
    tensor, raw is its rows row.. and goes into their records there (a large tensor packed a chunk at a time); by
    kernels_pack.cpp where the kernels run."""
    kind = GGUF_TYPES[qtype]
    n = raw.shape[0] if n is None else n
    tile = kind.tile
    if available():
        if out is None:
            out = torch.empty(packed_shape(qtype, n, raw.shape[1] // kind.bytes * kind.values), dtype=torch.uint8)
        torch.ops.lmstack.pack_gguf_into(raw.contiguous(), out, row, n, kind.bytes, kind.regrouped,
                                         len(kind.float16_at), kind.float16_at[0], qtype in FIFTH_BITS, qtype == Q8_0)
        return out
    if out is None:
        return _pack_gguf(raw, qtype)
    first, stop = row // tile, -(-(row + raw.shape[0]) // tile)  # the records raw's rows are in
    rows = unpack_gguf(out[first:stop], qtype, (stop - first) * tile)[:min(n, stop * tile) - first * tile].clone()
    rows[row - first * tile:row - first * tile + raw.shape[0]] = raw
    out[first:stop] = _pack_gguf(rows, qtype)
    return out


def read_pack_gguf(fd: int, offset: int, source: torch.Tensor | None, out: torch.Tensor, row: int, rows: int, n: int,
                   qtype: int, unit: int) -> tuple[int, int]:
    """pack_gguf of a tensor's `rows` rows straight from the file (its bytes at `offset`), into rows row.. of
    out, the records of an n-row tensor (BF16: tile_int8's tiles, in bytes): output row row + i is the file's row
    source[i] (None: i); each thread reads, checks and packs `unit` rows (whole tiles) at a time (kernels_pack.cpp).
    (The first row * blocks + block whose float16 scale is inf or nan, or -1; 0, an errno, or -1 where the file
    ended first.)"""
    kind = block_kind(qtype)
    source = torch.empty(0, dtype=torch.long) if source is None else source
    return torch.ops.lmstack.read_pack_gguf(fd, offset, source, out, row, rows, n, kind.bytes, kind.regrouped,
                                            list(kind.float16_at), qtype in FIFTH_BITS, qtype == Q8_0, unit)


def pread_parallel(fd: int, offset: int, buffer: memoryview) -> int:
    """Fill buffer (writable bytes) from the file at offset on the kernels' threads: the bytes read (fewer where the
    file ends first), or -errno."""
    return torch.ops.lmstack.pread_parallel(fd, offset, torch.frombuffer(buffer, dtype=torch.uint8))


FINITE_CHECKED = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes kernels_pack.cpp's any_nonfinite reads


def all_finite(tensor: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether a floating-point tensor holds no inf or nan: by kernels_pack.cpp where the kernels run (at the
    read's rate), else torch.isfinite a slice at a time, so a large tensor costs no bool copy of itself."""
    if available() and tensor.is_cpu and tensor.is_contiguous() and tensor.dtype in FINITE_CHECKED:
        return not torch.ops.lmstack.any_nonfinite(tensor)
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def first_nonfinite_float16(blocks: np.ndarray, at: int) -> int | None:
    """The first of (rows, blocks, block bytes) uint8 blocks whose float16 at byte `at` is inf or nan, as row *
    blocks + block, or None; by kernels_pack.cpp where the kernels run."""
    if available():
        first = torch.ops.lmstack.first_nonfinite_float16(torch.from_numpy(blocks), blocks.shape[-1], at)
        return None if first < 0 else first
    bad = np.flatnonzero((blocks[..., at:at + 2].copy().view("<u2") & 0x7C00) == 0x7C00)
    return int(bad[0]) if bad.size else None


def _pack_gguf(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """pack_gguf of a whole tensor by PyTorch's operators."""
    kind = GGUF_TYPES[qtype]
    n, tile = raw.shape[0], kind.tile
    blocks = F.pad(raw.reshape(n, -1, kind.bytes), (0, 0, 0, 0, 0, -n % tile))
    tiled = blocks.view(-1, tile, blocks.shape[1], kind.bytes).transpose(1, 2)  # (tiles, K / values, tile, block)
    if not kind.regrouped:
        return tiled.reshape(*tiled.shape[:2], -1).contiguous()
    lo, hi = _scales_span(kind)
    fields = [tiled[..., at:at + 2] for at in kind.float16_at]
    if qtype in FIFTH_BITS:
        fields.append(_fifth_bits(tiled[..., hi:hi + 4]))
        hi += 4
    fields.append(_by_columns_of_four(torch.cat([tiled[..., :lo], tiled[..., hi:]], dim=-1), qtype == Q8_0))
    return torch.cat([f.reshape(*tiled.shape[:2], -1) for f in fields], dim=-1).contiguous()


def _scales_span(kind: BlockType) -> tuple:
    """The bytes of a block its float16 scales take, side by side: (start, stop)."""
    return kind.float16_at[0], kind.float16_at[-1] + 2


def unpack_gguf(packed: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """The (n, K / values * block bytes) rows of blocks pack_gguf was given."""
    kind = GGUF_TYPES[qtype]
    tiles, blocks = packed.shape[:2]
    tile = kind.tile
    if kind.regrouped:
        lo, hi = _scales_span(kind)
        scales = packed[..., :(hi - lo) * tile].reshape(tiles, blocks, (hi - lo) // 2, tile, 2).transpose(2, 3)
        scales = scales.reshape(tiles, blocks, tile, hi - lo)
        at = (hi - lo) * tile
        parts = []
        if qtype in FIFTH_BITS:
            parts.append(_fifth_bits_back(packed[..., at:at + 64]))
            at += 64
        parts.append(_by_columns_of_four_back(packed[..., at:], qtype == Q8_0))
        rest = torch.cat(parts, dim=-1)
        packed = torch.cat([rest[..., :lo], scales, rest[..., lo:]], dim=-1)
    return packed.reshape(tiles, blocks, tile, kind.bytes).transpose(1, 2).reshape(tiles * tile, -1)[:n]


def gguf_matvec(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, bias: torch.Tensor | None):
    """x @ w.T + bias for the n rows of pack_gguf's blocks: float32 x with each weight dequantized exactly,
    bfloat16 x quantized to int8 (per 256 columns as llama.cpp's Q8_K for the K-quants, per 32 for the others)
    with integer dot products (kernels_gguf.cpp)."""
    return torch.ops.lmstack.gguf_matvec(x, packed, qtype, n, bias)


def gguf_gemm(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias for many rows of float32 x (a prefill in the fp32 profile), w the n rows of pack_gguf's blocks
    dequantized a panel at a time inside one GEMM (kernels_gemm.cpp): the weights gguf_dequantize gives, without a
    dense copy of them. (bfloat16 rows take gguf_matvec's integer dot products, faster at any size.)"""
    return torch.ops.lmstack.gguf_gemm(x, packed, qtype, n, bias)


def gguf_dequantize(packed: torch.Tensor, qtype: int, n: int, k: int, rows: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32):
    """Rows of pack_gguf's blocks (all n, or `rows`) as float32, bit-equal to gguf.quants.dequantize (or those
    values rounded to bfloat16); without the kernels, by gguf.quants.dequantize itself."""
    if available():
        return torch.ops.lmstack.gguf_dequantize(packed, qtype, n, k, rows, dtype)
    raw = unpack_gguf(packed, qtype, n)
    raw = raw if rows is None else raw[rows.reshape(-1)]
    w = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType(qtype)).astype(np.float32))
    return w.reshape(*(rows.shape if rows is not None else (n,)), k).to(dtype)
