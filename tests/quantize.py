"""A test quantizer for the K types gguf-py cannot quantize (Q2_K to Q6_K): valid blocks, simple scales.

Scales come from each sub-block's min and max (no search, unlike llama.cpp's quantizer): the blocks are
what matters, and the tests' oracle is `gguf.quants.dequantize` of them, not llama.cpp's numbers. Each
packing below is the inverse of the layout gguf's dequantization reads. Other types go to gguf's own
`quantize`.
"""

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFValueType
from gguf.quants import dequantize, quantize as gguf_quantize

QK_K = 256


def _f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _bytes(x: np.ndarray) -> np.ndarray:
    """float16 or int8 values per block as (blocks, bytes) uint8."""
    return np.ascontiguousarray(x).view(np.uint8).reshape(x.shape[0], -1)


def _pack(q: np.ndarray, chunks: int, width: int, bits: int) -> np.ndarray:
    """(blocks, values) small unsigned ints -> bytes where value v of chunk c lies in byte c * width + v % width,
    at bit bits * (v // width within its chunk): the layout `gguf` unpacks with `>> [0, bits, 2 * bits, ...]`."""
    n = q.shape[0]
    q = q.astype(np.uint16).reshape(n, chunks, -1, width)
    shifts = (np.arange(q.shape[2], dtype=np.uint16) * bits).reshape(1, 1, -1, 1)
    return (q << shifts).sum(axis=2).astype(np.uint8).reshape(n, chunks * width)


def _scaled(scale: np.ndarray, levels: int):
    """Per-block float16 super-scale d and per-sub-block integer scales in [0, levels] with d * s ~ scale."""
    d = _f16(scale.max(axis=1) / levels)
    d32 = d.astype(np.float32)[:, None]
    s = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, levels)
    return d, s.astype(np.uint8), d32 * s


def _quants(x, step, offset, low, high):
    """Round (x + offset) / step to integers in [low, high] (0 where the step is 0)."""
    q = np.rint(np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0))
    return np.clip(q, low, high).astype(np.int16)


def _affine(x: np.ndarray, sub: int, q_max: int, s_max: int):
    """x = d * s * q - dmin * m over sub-blocks of `sub` values: (d, s, dmin, m, q)."""
    n = x.shape[0]
    x = x.reshape(n, -1, sub)
    lo = np.minimum(x.min(axis=2), 0)
    d, s, step = _scaled((x.max(axis=2) - lo) / q_max, s_max)
    dmin, m, offset = _scaled(-lo, s_max)
    q = _quants(x, step[..., None], offset[..., None], 0, q_max)
    return d, s, dmin, m, q.reshape(n, QK_K)


def _symmetric(x: np.ndarray, sub: int, q_low: int, q_high: int, s_max: int):
    """x = d * s * q over sub-blocks of `sub` values, q in [q_low, q_high], s in [0, s_max]: (d, s, q)."""
    n = x.shape[0]
    x = x.reshape(n, -1, sub)
    d, s, step = _scaled(np.abs(x).max(axis=2) / q_high, s_max)
    return d, s, _quants(x, step[..., None], 0, q_low, q_high).reshape(n, QK_K)


def _k_scales(s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 12 bytes of eight 6-bit scales and mins (gguf's Q4_K.get_scale_min, inverted)."""
    low = (s[:, :4] & 0x3F) | ((s[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    high = (s[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, mid, high], axis=1).astype(np.uint8)


def q2_k(x):
    d, s, dmin, m, q = _affine(x, 16, 3, 15)
    return np.concatenate([s | (m << 4), _pack(q, 2, 32, 2), _bytes(d[:, None]), _bytes(dmin[:, None])], axis=1)


def q3_k(x):
    d, s, q = _symmetric(x, 16, -4, 3, 31)
    s = s + 32  # stored as scale + 32 in 6 bits
    low = _pack(s & 0x0F, 1, 8, 4)
    high = _pack(s >> 4, 1, 4, 2)
    high_bit = (q >= 0).astype(np.uint8)  # set: q = low bits; clear: q = low bits - 4
    return np.concatenate([_pack(high_bit, 1, 32, 1), _pack(q + 4 * (1 - high_bit), 2, 32, 2), low, high,
                           _bytes(d[:, None])], axis=1)


def q4_k(x):
    d, s, dmin, m, q = _affine(x, 32, 15, 63)
    return np.concatenate([_bytes(d[:, None]), _bytes(dmin[:, None]), _k_scales(s, m), _pack(q, 4, 32, 4)], axis=1)


def q5_k(x):
    d, s, dmin, m, q = _affine(x, 32, 31, 63)
    return np.concatenate([_bytes(d[:, None]), _bytes(dmin[:, None]), _k_scales(s, m), _pack(q >> 4, 1, 32, 1),
                           _pack(q & 15, 4, 32, 4)], axis=1)


def q6_k(x):
    d, s, q = _symmetric(x, 16, -32, 31, 127)
    q = q + 32
    return np.concatenate([_pack(q & 15, 2, 64, 4), _pack(q >> 4, 2, 32, 2), _bytes(s.astype(np.int8)),
                           _bytes(d[:, None])], axis=1)


K_QUANTIZERS = {Q.Q2_K: q2_k, Q.Q3_K: q3_k, Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k}


def quantize(weight: np.ndarray, qtype: Q) -> np.ndarray:
    """weight (..., K) float -> its blocks as a GGUF stores them, (..., K / block * block bytes) uint8."""
    if qtype not in K_QUANTIZERS:
        return gguf_quantize(weight, qtype)
    if weight.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} takes rows of a multiple of {QK_K} values, not {weight.shape[-1]}")
    blocks = np.asarray(weight, dtype=np.float32).reshape(-1, QK_K)
    return K_QUANTIZERS[qtype](blocks).reshape(*weight.shape[:-1], -1)


# llama.cpp's quantizer: for a row length that is not a multiple of 256, the type it takes instead
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def k_m(base: Q, more: Q):
    """A "_K_M" mix in llama.cpp's manner (gguf names): the head (or the tied embedding) in Q6_K, attn_v and
    ffn_down in `more` on more_bits layers, the rest of the matrices in `base`, norms as they are."""
    def choose(name: str, n_layers: int, tied: bool) -> Q | None:
        if name.endswith("norm.weight") or not name.endswith(".weight"):
            return None
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            return Q.Q6_K
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and more_bits(int(parts[1]), n_layers):
            return more
        return base
    return choose


def requantize_gguf(src, dst, choose):
    """Write GGUF `src` again as `dst`, metadata copied, each matrix in choose(gguf name, layers, tied) (None: kept)
    or its FALLBACK where a row's length is not a multiple of 256. The q/k rows keep llama.cpp's order."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layers = reader.fields[f"{arch}.block_count"].contents()
    tied = all(t.name != "output.weight" for t in reader.tensors)
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind, field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        qtype = choose(t.name, n_layers, tied) if len(shape) == 2 else None
        if qtype is None or qtype == t.tensor_type:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        qtype = FALLBACK.get(qtype, qtype) if shape[-1] % QK_K else qtype
        weight = dequantize(t.data, t.tensor_type).reshape(shape)
        writer.add_tensor(t.name, quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
