"""weight_format "gguf": a GGUF's blocks of every type the kernels take multiplied as stored, against gguf's own
dequantize (the weights) and llama.cpp's arithmetic recomputed here (bfloat16 activations)."""

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import test_gguf
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from test_gguf import write_gguf

from lmstack import CausalLM, UnsupportedModel, kernels, models
from lmstack import model as model_module
from lmstack.checkpoint import CheckpointError
from lmstack.formats import GGUFBlocks, MatvecLinear
from lmstack.gguf import GGUFFile

BLOCK_TYPES = [Q(i) for i in kernels.GGUF_TYPES]
K_QUANTS = [q for q in BLOCK_TYPES if kernels.GGUF_TYPES[q.value].values == 256]
# where each K-quant keeps its integer sub-block scales (and mins): bytes set to extremes in some blocks
SUB_SCALES = {Q.Q2_K: (0, 16), Q.Q3_K: (96, 108), Q.Q4_K: (4, 16), Q.Q5_K: (4, 16), Q.Q6_K: (192, 208)}
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="lmstack's CPU kernels do not run here")
by_name = dict(ids=lambda q: q.name)


def columns(qtype) -> int:
    return 3 * kernels.GGUF_TYPES[qtype.value].values + (32 if kernels.GGUF_TYPES[qtype.value].values == 32 else 0)


def random_blocks(qtype, rows, cols, seed=0) -> np.ndarray:
    """Random rows of blocks whose float16 scales (d, and dmin or m) are any finite value: normal, subnormal,
    zero, negative zero, the largest; and whose integer sub-block scales and mins take every bit pattern, the
    extremes (all zeros, all ones, 0x80 and 0x7F bytes) in whole blocks."""
    kind = kernels.GGUF_TYPES[qtype.value]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // kind.values, kind.bytes), dtype=np.uint8)
    if qtype in SUB_SCALES:
        lo, hi = SUB_SCALES[qtype]
        for row, byte in enumerate((0x00, 0xFF, 0x80, 0x7F)):
            raw[row, 0, lo:hi] = byte
    for i, at in enumerate(kind.float16_at):
        scales = raw[..., at:at + 2].copy().view(np.uint16)
        finite = (scales & 0x7C00) != 0x7C00
        scales = np.where(finite, scales, scales & 0x83FF)  # an inf/nan exponent becomes a subnormal one
        scales.flat[i:i + 12:2] = [0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFBFF]
        raw[..., at:at + 2] = scales.view(np.uint8).reshape(raw[..., at:at + 2].shape)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, **by_name)
@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "pytorch"])
def test_dequantized_blocks_are_bit_equal_to_gguf(qtype, use_kernels, monkeypatch):
    if use_kernels and not kernels.available():
        pytest.skip("lmstack's CPU kernels do not run here")
    if not use_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    rows, cols = 21, columns(qtype)  # rows not a multiple of the tile: padding rows are never read back
    raw = random_blocks(qtype, rows, cols)
    expected = dequantize(raw, qtype).astype(np.float32)
    blocks = GGUFBlocks(torch.from_numpy(raw), qtype.value, cols)
    assert np.array_equal(blocks.dense().numpy().view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([[20, 0], [7, 7]])
    assert np.array_equal(blocks.dense(ids).numpy().view(np.uint32), expected[ids.numpy()].view(np.uint32))
    rounded = blocks.dense(dtype=torch.bfloat16)
    assert torch.equal(rounded, torch.from_numpy(expected).bfloat16())


@pytest.mark.parametrize("qtype", BLOCK_TYPES, **by_name)
@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "pytorch"])
def test_packing_by_chunks_of_rows_is_packing_the_whole(qtype, use_kernels, monkeypatch):
    """A tensor packed a chunk of rows at a time into one buffer, chunks starting and ending inside tiles, is the
    whole tensor packed by PyTorch's operators (padding rows included), and unpacks to the file's rows."""
    if use_kernels and not kernels.available():
        pytest.skip("lmstack's CPU kernels do not run here")
    if not use_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    rows, cols = 21, columns(qtype)
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=3))
    expected = kernels._pack_gguf(raw, qtype.value)
    assert torch.equal(kernels.pack_gguf(raw, qtype.value), expected)
    into = torch.full_like(expected, 0x55)
    for start, stop in ((0, 5), (5, 13), (13, 19), (19, 21)):  # across tiles of 8 and of 16 rows
        kernels.pack_gguf(raw[start:stop], qtype.value, into, start, rows)
    assert torch.equal(into, expected)
    assert torch.equal(kernels.unpack_gguf(into, qtype.value, rows), raw)


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES, **by_name)
def test_float32_products_are_the_dequantized_weights_times_x(qtype):
    """Each weight dequantized exactly, products summed in float32: within gamma_K * sum |w x| of the float64 sum."""
    rows, cols = 19, columns(qtype)
    raw = random_blocks(qtype, rows, cols, seed=1)
    w = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).double()
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(rows)
    packed = kernels.pack_gguf(torch.from_numpy(raw), qtype.value)
    y = kernels.gguf_matvec(x, packed, qtype.value, rows, bias)
    eye = torch.eye(cols)  # each product with one is the weight itself, each sum adds zeros: the weights' bits
    assert torch.equal(kernels.gguf_matvec(eye, packed, qtype.value, rows, None).T, w.float())
    exact = x.double() @ w.T + bias.double()
    bound = cols * 2.0 ** -24 * (x.double().abs() @ w.abs().T + bias.double().abs()) * 1.01
    assert ((y.double() - exact).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], **by_name)
def test_bfloat16_prefill_without_amx_takes_the_block_kernels_for_every_row(qtype, monkeypatch):
    """Where lmstack's GEMMs serve prefill (no AMX), a bfloat16 prefill of many rows keeps llama.cpp's integer dot
    products: each row's outputs are those of the row alone (no bfloat16 GEMM on dequantized weights)."""
    monkeypatch.setattr(kernels, "gemm_for_prefill", lambda: True)
    rows, cols = 40, 512
    raw = random_blocks(qtype, rows, cols, seed=4)
    blocks = GGUFBlocks(torch.from_numpy(raw), qtype.value, cols)
    x = torch.randn(300, cols, generator=torch.Generator().manual_seed(1)).bfloat16()
    alone = torch.cat([kernels.gguf_matvec(x[i:i + 1], blocks.weight, qtype.value, rows, None) for i in range(300)])
    assert torch.equal(blocks(x), alone)


@needs_kernels
def test_the_kernels_refuse_rows_that_are_not_whole_blocks_by_saying_so():
    packed = kernels.pack_gguf(torch.from_numpy(random_blocks(Q.Q6_K, 16, 512, seed=5)), Q.Q6_K.value)
    with pytest.raises(RuntimeError, match=r"Q6_K w's rows must be whole blocks of 256 columns, got 576"):
        kernels.gguf_matvec(torch.randn(1, 576), packed, Q.Q6_K.value, 16, None)


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES, **by_name)
def test_float32_prefill_multiplies_the_exact_weights(qtype):
    """Many rows of float32 x (a prefill in the fp32 profile): the weights dequantized exactly, products summed in
    float32, a sum per block of columns: times the identity each output is the weight itself; otherwise within
    float32's bound of the exact product and about as near it as F.linear on the dequantized matrix. Columns in
    several blocks, rows past a register block and a panel."""
    values = kernels.GGUF_TYPES[qtype.value].values
    rows, cols = 37, 5 * 256 if values == 256 else 34 * 32
    raw = random_blocks(qtype, rows, cols, seed=3)
    w = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    packed = kernels.pack_gguf(torch.from_numpy(raw), qtype.value)
    assert torch.equal(kernels.gguf_gemm(torch.eye(cols), packed, qtype.value, rows, None).T, w)
    x = torch.randn(29, cols, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(rows)
    y = kernels.gguf_gemm(x, packed, qtype.value, rows, bias)
    exact = x.double() @ w.double().T + bias.double()
    bound = cols * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + bias.double().abs()) * 1.01
    assert y.dtype == torch.float32 and ((y.double() - exact).abs() <= bound).all()
    error = lambda t: (t.double() - exact).abs().mean() / exact.abs().mean()
    assert error(y) <= 2 * error(torch.nn.functional.linear(x, w, bias))


def quantized_rows(x: torch.Tensor, values: int):
    """x's rows quantized as llama.cpp quantizes them for the type's dot product, (q, d per block): per 256 values
    (Q8_K) the value of largest magnitude, max, gives iscale = -127 / max, q = min(127, rint(iscale * x)),
    d = 1 / iscale; per 32 values (the kernels' Q8_0, d in float32) q = rint(x * (127 / amax)), d = amax / 127."""
    blocks = x.float().reshape(x.shape[0], -1, values)
    amax = blocks.abs().amax(-1, keepdim=True)
    if values == 32:
        inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.tensor(0.0))
        return torch.round(blocks * inv), amax / 127
    top = blocks.gather(-1, (blocks.abs() == amax).int().argmax(-1, keepdim=True))  # the first such value
    iscale = torch.where(amax > 0, torch.tensor(-127.0) / top, torch.tensor(0.0))
    return torch.round(iscale * blocks).clamp(max=127), torch.where(amax > 0, 1 / iscale, torch.tensor(0.0))


def integer_parts(raw: np.ndarray, qtype):
    """Each weight as d * a + e * b, d and e the block's float16 scales (d, and dmin or m): (d, e, a, b) per block,
    a and b the integers gguf's dequantize gives with the scales set to (1, 0) and to (0, 1)."""
    kind = kernels.GGUF_TYPES[qtype.value]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, kind.bytes)
    scales = [blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64) for at in kind.float16_at]
    parts = []
    for one in range(len(kind.float16_at)):
        unit = blocks.copy()
        for i, at in enumerate(kind.float16_at):
            unit[..., at:at + 2] = np.array([1.0 if i == one else 0.0], np.float16).view(np.uint8)
        parts.append(dequantize(unit.reshape(rows, -1), qtype).astype(np.float64).reshape(rows, blocks.shape[1], -1))
    if len(parts) == 1:  # no second scale
        scales.append(np.zeros_like(scales[0])), parts.append(np.zeros_like(parts[0]))
    return [torch.from_numpy(v) for v in (*scales, *parts)]


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES, **by_name)
def test_bfloat16_products_are_integer_dot_products_of_int8_activations(qtype):
    """Under bfloat16 activations x is quantized as llama.cpp quantizes it for the type, and each block's integer
    dot products are exact: the result is the float64 sum over blocks of d_x * (d * a.q_x + e * b.q_x), up to
    float32 rounding of each block's terms and the bfloat16 output; each row's result is its result alone."""
    rows, cols = 19, columns(qtype)
    values = kernels.GGUF_TYPES[qtype.value].values
    raw = random_blocks(qtype, rows, cols, seed=2)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[0, :values] = 0  # a block of zeros: d_x = 0
    x[1, 5] = -40  # a block whose value of largest magnitude is negative
    packed = kernels.pack_gguf(torch.from_numpy(raw), qtype.value)
    y = kernels.gguf_matvec(x, packed, qtype.value, rows, None)
    for i in range(6):
        assert torch.equal(y[i], kernels.gguf_matvec(x[i:i + 1], packed, qtype.value, rows, None)[0])
    assert torch.equal(y[:4], kernels.gguf_matvec(x[:4], packed, qtype.value, rows, None))
    xq, dx = quantized_rows(x, values)
    d, e, a, b = integer_parts(raw, qtype)
    xq, dx = xq.double(), dx.double()[..., 0]
    terms = (d[None] * torch.einsum("rbk,mbk->mrb", a, xq) + e[None] * torch.einsum("rbk,mbk->mrb", b, xq)) \
        * dx[:, None, :]  # (m, rows, blocks)
    expected = terms.sum(-1)
    bound = 1e-5 * terms.abs().sum(-1) + 2.0 ** -8 * expected.abs()  # float32 sums, then bfloat16 output
    assert ((y.double() - expected).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES, **by_name)
def test_a_row_gets_its_bits_alone_in_any_engine_step(qtype):
    """Many rows (an engine step) share each pass over the blocks (the regrouped types: up to 16 at a time, the next
    tile prefetched across the passes, one row alone by its own code; Q2_K, Q3_K: all rows, x block-major): each
    row's result is the bits it gets alone, whatever its batch-mates and however many."""
    rows, cols = 21, 2 * columns(qtype)
    packed = kernels.pack_gguf(torch.from_numpy(random_blocks(qtype, rows, cols, seed=3)), qtype.value)
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([kernels.gguf_matvec(x[i:i + 1], packed, qtype.value, rows, None) for i in range(len(x))])
    for m in (2, 3, 5, 6, 7, 15, 16, 17, 20):
        assert torch.equal(kernels.gguf_matvec(x[:m], packed, qtype.value, rows, None), alone[:m]), m
    assert torch.equal(kernels.gguf_matvec(x[9:], packed, qtype.value, rows, None), alone[9:])


@needs_kernels
@pytest.mark.parametrize("qtype", K_QUANTS, **by_name)
def test_bfloat16_products_do_not_depend_on_the_thread_count(qtype):
    """Tiles split between two threads (each thread's share taken a chunk at a time, the back half of what is left
    of one taken by the other once it is done with its own; the last tile short) give each row the numbers one
    thread gives it, for one row of x (decode) and for several."""
    rows, cols = 40 * kernels.TILE - 3, 256
    packed = kernels.pack_gguf(torch.from_numpy(random_blocks(qtype, rows, cols, seed=3)), qtype.value)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernels.gguf_matvec(x[:m], packed, qtype.value, rows, None) for m in (1, 3)]
        torch.set_num_threads(2)
        shared = [kernels.gguf_matvec(x[:m], packed, qtype.value, rows, None) for m in (1, 3)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))


def plausible_blocks(w: np.ndarray, qtype) -> np.ndarray:
    """Blocks of qtype, which gguf cannot quantize to, in the place of matrix w: random quants and sub-block
    scales, the float16 scales (d, and dmin or m) set so that the weights spread as w's do."""
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    float16_at = kernels.GGUF_TYPES[qtype.value].float16_at if qtype.value in kernels.GGUF_TYPES else (0,)
    rows = w.shape[0]
    raw = np.random.default_rng(w.size).integers(0, 256, (rows, w.shape[1] // size, nbytes), dtype=np.uint8)
    for at in float16_at:
        raw[..., at:at + 2] = np.array([1.0], np.float16).view(np.uint8)
    scale = np.array([w.std() / dequantize(raw.reshape(rows, -1), qtype).std()], np.float16).view(np.uint8)
    for at in float16_at:
        raw[..., at:at + 2] = scale
    return raw.reshape(rows, -1)


def quantize_or_make_up(w: np.ndarray, qtype) -> np.ndarray:
    try:
        return quantize(w, qtype)
    except NotImplementedError:
        return plausible_blocks(w, qtype)


def tiny_gguf(tiny_checkpoint, tmp_path, name, **types):
    """A tiny model written as a GGUF (test_gguf.write_gguf), the types gguf cannot quantize to as plausible_blocks."""
    _, reference = tiny_checkpoint(name)
    path = tmp_path / f"{name}.gguf"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_gguf, "quantize", quantize_or_make_up)
        write_gguf(path, reference, arch="qwen2" if name.startswith("qwen2") else "llama", **types)
    return path


MIXED = {"model.layers.0.self_attn.v_proj.weight": Q.Q8_0, "model.layers.1.mlp.up_proj.weight": Q.BF16,
         "model.layers.1.self_attn.o_proj.weight": Q.F16, "model.layers.0.mlp.down_proj.weight": Q.Q5_0,
         "model.layers.1.mlp.gate_proj.weight": Q.Q5_1, "model.embed_tokens.weight": Q.Q4_1}
# every K-quant, Q5_0 and Q5_1 in one model, its tied embedding Q6_K as in a Q4_K_M file
K_MIXED = {"model.layers.0.self_attn.q_proj.weight": Q.Q2_K, "model.layers.0.self_attn.k_proj.weight": Q.Q3_K,
           "model.layers.0.self_attn.v_proj.weight": Q.Q6_K, "model.layers.0.self_attn.o_proj.weight": Q.Q5_K,
           "model.layers.0.mlp.gate_proj.weight": Q.Q5_0, "model.layers.0.mlp.up_proj.weight": Q.Q5_1,
           "model.layers.1.mlp.down_proj.weight": Q.Q6_K, "model.embed_tokens.weight": Q.Q6_K}


@needs_kernels
@pytest.mark.parametrize("name,qtype,types", [
    ("llama_tied_gqa", Q.Q8_0, None), ("llama_tied_gqa", Q.Q4_0, None), ("llama", Q.Q4_1, None),
    ("qwen2_sliding", Q.Q4_0, None), ("llama_tied_gqa", Q.Q4_0, MIXED), ("llama_wide", Q.Q4_K, K_MIXED)],
    ids=["Q8_0-tied", "Q4_0-tied", "Q4_1", "Q4_0-qwen2-bias", "mixed", "K-quants-tied"])
def test_logits_match_a_float32_model_of_the_dequantized_weights(tiny_checkpoint, tmp_path, name, qtype, types):
    """Under fp32 the stored blocks give the logits of float32 weights that gguf dequantized, up to float32
    summation order (1e-4 on logits of size ~1), and the same greedy tokens; bfloat16 stays within its rounding.
    The mixed files fuse parts of different types."""
    path = tiny_gguf(tiny_checkpoint, tmp_path, name, qtype=qtype, tensor_types=types)
    dense = CausalLM.load(path, device="cpu")
    stored = CausalLM.load(path, weight_format="gguf", device="cpu")
    ids = torch.randint(0, dense.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = dense.forward(ids)
    torch.testing.assert_close(stored.forward(ids), expected, rtol=1e-4, atol=1e-4)  # many rows: dense matmul
    state = stored.allocate_state(2, 9)
    torch.testing.assert_close(torch.cat([stored.step(ids[:, i], state)[:, None] for i in range(9)], 1), expected,
                               rtol=1e-4, atol=1e-4)  # one row at a time: the block kernels
    assert torch.equal(stored.generate(ids, 6), dense.generate(ids, 6))
    for key, weight in dense.parameters().items():
        torch.testing.assert_close(stored.parameters()[key], weight, rtol=0, atol=0, msg=key)
    fast = CausalLM.load(path, weight_format="gguf", numeric_profile="bf16", device="cpu")
    scale = expected.abs().max()
    assert (fast.forward(ids) - expected).abs().max() <= 0.05 * scale
    state = fast.allocate_state(2, 9)
    steps = torch.cat([fast.step(ids[:, i], state)[:, None] for i in range(9)], 1)
    assert (steps - expected).abs().max() <= 0.05 * scale


BF16_PARTS = {f"model.layers.{i}.{name}.weight": Q.BF16 for i in range(2)
              for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj")}


@needs_kernels
def test_bf16_matrices_are_read_straight_into_tiles_under_bf16_arithmetic(tiny_checkpoint, tmp_path):
    """Without mmap, under the bf16 profile a BF16 file's q, k and v (rows permuted by llama.cpp's converter) are
    read into one tiled matrix, as tile_int8 tiles the file's values in Hugging Face's order (the kernel then
    computes what it computed on tile_int8's tiles); a BF16 matrix beside blocks of another type stays a part of its
    own."""
    path = tiny_gguf(tiny_checkpoint, tmp_path, "llama_tied_gqa", qtype=Q.Q8_0, tensor_types=BF16_PARTS)
    exact = CausalLM.load(path, weight_format="gguf", device="cpu").parameters()
    lm = CausalLM.load(path, weight_format="gguf", numeric_profile="bf16", device="cpu", mmap=False)
    qkv = lm.blocks[0].attn.qkv.parts
    assert len(qkv) == 1 and isinstance(qkv[0], MatvecLinear) and qkv[0].tiled
    fused = torch.cat([exact[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]).bfloat16()
    assert torch.equal(qkv[0].weight, kernels.tile_int8(fused))
    assert [type(p) for p in lm.blocks[0].mlp.gate_up.parts] == [GGUFBlocks, MatvecLinear]
    for name, weight in exact.items():
        if name in BF16_PARTS:
            assert torch.equal(lm.parameters()[name].float(), weight), name


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's memory (/proc/self/maps), or None (anonymous memory)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


@needs_kernels
@pytest.mark.parametrize("profile", ["bf16", "fp32"])
def test_bf16_matrices_stay_in_the_files_pages(tiny_checkpoint, tmp_path, profile):
    """By default (mmap) a BF16 matrix in Hugging Face's row order (v, up, a BF16 embedding) is used from the file's
    own pages, nothing copied, and q and k, whose rows llama.cpp's converter permuted, are read into tiles; the
    model computes exactly what the tiled copy (mmap=False) computes: prompt, steps and greedy tokens."""
    types = BF16_PARTS | {"model.embed_tokens.weight": Q.BF16}
    path = tiny_gguf(tiny_checkpoint, tmp_path, "llama_tied_gqa", qtype=Q.Q8_0, tensor_types=types)
    exact = CausalLM.load(path, weight_format="gguf", device="cpu", mmap=False).parameters()
    mapped = CausalLM.load(path, weight_format="gguf", numeric_profile=profile, device="cpu")
    tiled = CausalLM.load(path, weight_format="gguf", numeric_profile=profile, device="cpu", mmap=False)
    q_and_k, v = mapped.blocks[0].attn.qkv.parts
    assert q_and_k.tiled and mapped_file(q_and_k.weight) is None
    assert not v.tiled and mapped_file(v.weight) == str(path.resolve())
    up = mapped.blocks[1].mlp.gate_up.parts[1]
    assert mapped_file(up.weight) == mapped_file(mapped.embed) == str(path.resolve())
    assert mapped_file(tiled.blocks[0].attn.qkv.parts[0].weight) is None
    weights = mapped.parameters()
    for name in types:
        assert torch.equal(weights[name].float(), exact[name]), name
    ids = torch.tensor([[1, 5, 9, 200, 7, 3, 11, 42] * 5])  # past the few-row kernels: the GEMMs
    states = [lm.allocate_state(1, 64) for lm in (mapped, tiled)]
    logits = [lm.forward(ids, state) for lm, state in zip((mapped, tiled), states)]
    assert torch.equal(logits[0], logits[1])
    token = int(logits[0][0, -1].argmax())
    for _ in range(4):
        steps = [lm.step([token], state) for lm, state in zip((mapped, tiled), states)]
        assert torch.equal(steps[0], steps[1])
        token = int(steps[0].argmax())


def test_a_file_that_cannot_be_mapped_is_named_with_the_way_around(tiny_checkpoint, tmp_path, monkeypatch):
    """Where the file's filesystem cannot map it, the load says so, naming the file and mmap=False, which reads the
    BF16 matrices into memory instead (and maps no file: anonymous memory only)."""
    import mmap

    path = tiny_gguf(tiny_checkpoint, tmp_path, "llama_tied_gqa", qtype=Q.Q8_0, tensor_types=BF16_PARTS)
    anonymous = mmap.mmap

    def files_unmappable(fileno, *args, **kwargs):
        if fileno != -1:
            raise OSError(19, "No such device")
        return anonymous(fileno, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", files_unmappable)
    with pytest.raises(OSError, match=rf"{path.name} cannot be mapped \(No such device\): load it with mmap=False"):
        CausalLM.load(path, weight_format="gguf", device="cpu")
    CausalLM.load(path, weight_format="gguf", device="cpu", mmap=False)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], **by_name)
def test_weights_packed_a_row_at_a_time_are_the_weights_packed_whole(tiny_checkpoint, tmp_path, qtype, monkeypatch):
    """q and k (whose rows llama.cpp permuted within each head) read by slices that cut heads are the slices of the
    whole tensor, and a model packed a row at a time (chunks ending inside tiles and heads, the parts of a fused
    projection meeting inside a tile) holds the bytes of one packed by the default chunks."""
    path = tiny_gguf(tiny_checkpoint, tmp_path, "llama_tied_gqa" if qtype == Q.Q8_0 else "llama_wide", qtype=qtype)
    with GGUFFile(path) as f:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
            whole = f.stored(name)[1]
            for start, stop in ((0, 3), (3, 11), (5, whole.shape[0])):
                assert torch.equal(f.stored(name, slice(start, stop))[1], whole[start:stop]), (name, start, stop)
    def packed(lm):
        blocks = {name: m.weight for name, m in lm.blocks.named_modules() if isinstance(m, GGUFBlocks)}
        return blocks | ({"embed": lm.embed.weight} if isinstance(lm.embed, GGUFBlocks) else {})

    chunked = packed(CausalLM.load(path, weight_format="gguf", device="cpu"))
    monkeypatch.setattr(model_module, "PACK_CHUNK_BYTES", 1)
    by_rows = packed(CausalLM.load(path, weight_format="gguf", device="cpu"))
    assert by_rows.keys() == chunked.keys() and any("qkv" in name or "q_proj" in name for name in chunked)
    for name, weight in by_rows.items():
        assert torch.equal(weight, chunked[name]), name


def test_gguf_format_refuses_other_checkpoints_by_name(tiny_checkpoint):
    path, reference = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match=r"weight_format 'gguf'.*is not a GGUF file"):
        CausalLM.load(path, weight_format="gguf", device="cpu")
    lm = CausalLM.load(path, device="cpu")
    with pytest.raises(ValueError, match=r"weight_format 'gguf'.*weights is not a GGUF file"):
        CausalLM(lm.plan, lm.parameters(), weight_format="gguf", device="cpu")


def test_a_non_finite_scale_is_refused_by_tensor_name(tiny_checkpoint, tmp_path):
    path = tiny_gguf(tiny_checkpoint, tmp_path, "llama", qtype=Q.Q8_0)
    from lmstack.gguf import GGUFHeader

    with GGUFHeader(path) as header:
        offset = header.tensors["blk.1.ffn_up.weight"].offset
    data = bytearray(path.read_bytes())
    data[offset:offset + 2] = np.array([0x7C00], dtype="<u2").tobytes()  # d = +inf
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*inf or nan"):
        CausalLM.load(path, weight_format="gguf", device="cpu")


@needs_kernels
def test_the_default_model_as_stored_matches_its_dequantized_float32():
    """SmolLM2's Q4_1 blocks and Q8_0 tied head as stored: the logits of the float32 model gguf dequantizes, up to
    float32 summation order (5e-4 on logits of size ~30), and its greedy tokens."""
    path = models.smollm2()
    dense = CausalLM.load(path, device="cpu")
    stored = CausalLM.load(path, weight_format="gguf", device="cpu")
    assert stored.weight_format == "gguf" and not stored.unused_names
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    torch.testing.assert_close(stored.forward(ids), dense.forward(ids), rtol=0, atol=5e-4)
    assert torch.equal(stored.generate(ids, 12), dense.generate(ids, 12))
    stored_bytes = sum(p.weight.numel() for m in stored.blocks for p in m.modules() if isinstance(p, GGUFBlocks))
    assert stored_bytes < 0.2 * sum(w.numel() * 4 for k, w in dense.parameters().items() if "layers" in k)
    assert math.isfinite(float(stored.forward(ids).abs().max()))


def test_a_type_without_kernels_is_refused_unless_dequantized_storage_is_asked_for(tiny_checkpoint, tmp_path):
    """IQ4_NL has no kernel: weight_format "gguf" refuses the file naming the tensor and the type rather than
    widening it to float32 behind the user's back; float32 storage dequantizes it, as gguf does."""
    name = "model.layers.0.mlp.up_proj.weight"
    path = tiny_gguf(tiny_checkpoint, tmp_path, "llama", qtype=Q.Q8_0, tensor_types={name: Q.IQ4_NL})
    with pytest.raises(UnsupportedModel, match=r"'blk\.0\.ffn_up\.weight' has type IQ4_NL.*weight_format 'float32'"):
        CausalLM.load(path, weight_format="gguf", device="cpu")
    dense = CausalLM.load(path, weight_format="float32", device="cpu")
    with GGUFFile(path) as f:
        assert torch.equal(dense.parameters()[name], f.read(name))
