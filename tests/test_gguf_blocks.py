"""weight_format "gguf": a GGUF's Q8_0, Q4_0 and Q4_1 blocks multiplied as stored, against gguf's own dequantize."""

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from test_gguf import write_gguf

from lmstack import CausalLM, kernels, models
from lmstack.checkpoint import CheckpointError
from lmstack.formats import GGUFBlocks

BLOCK_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1]
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="lmstack's CPU kernels do not run here")


def random_blocks(qtype, rows, cols, seed=0) -> np.ndarray:
    """Random rows of blocks whose float16 scales (d, and Q4_1's m) are any finite value: normal, subnormal,
    zero, negative zero, the largest."""
    rng = np.random.default_rng(seed)
    block, head = kernels.GGUF_BLOCKS[qtype.value]
    raw = rng.integers(0, 256, size=(rows, cols // 32, block), dtype=np.uint8)
    scales = raw[..., :head].copy().view(np.uint16)
    finite = (scales & 0x7C00) != 0x7C00
    scales = np.where(finite, scales, scales & 0x83FF)  # an inf/nan exponent becomes a subnormal one
    scales.flat[:6] = [0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFBFF]
    raw[..., :head] = scales.view(np.uint8).reshape(raw[..., :head].shape)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernels", "pytorch"])
def test_dequantized_blocks_are_bit_equal_to_gguf(qtype, use_kernels, monkeypatch):
    if use_kernels and not kernels.available():
        pytest.skip("lmstack's CPU kernels do not run here")
    if not use_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    rows, cols = 21, 128  # rows not a multiple of the tile: padding rows are never read back
    raw = random_blocks(qtype, rows, cols)
    expected = dequantize(raw, qtype).astype(np.float32)
    blocks = GGUFBlocks(torch.from_numpy(raw), qtype.value, cols)
    assert np.array_equal(blocks.dense().numpy().view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([[20, 0], [7, 7]])
    assert np.array_equal(blocks.dense(ids).numpy().view(np.uint32), expected[ids.numpy()].view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_float32_products_are_the_dequantized_weights_times_x(qtype):
    """Each weight dequantized exactly, products summed in float32: within gamma_K * sum |w x| of the float64 sum."""
    rows, cols = 19, 160
    raw = random_blocks(qtype, rows, cols, seed=1)
    w = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).double()
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(rows)
    y = kernels.gguf_matvec(x, kernels.pack_gguf(torch.from_numpy(raw), qtype.value), qtype.value, rows, bias)
    eye = torch.eye(cols)  # each product with one is the weight itself, each sum adds zeros: the weights' bits
    packed = kernels.pack_gguf(torch.from_numpy(raw), qtype.value)
    assert torch.equal(kernels.gguf_matvec(eye, packed, qtype.value, rows, None).T, w.float())
    exact = x.double() @ w.T + bias.double()
    bound = cols * 2.0 ** -24 * (x.double().abs() @ w.abs().T + bias.double().abs()) * 1.01
    assert ((y.double() - exact).abs() <= bound).all()


def quantized_rows(x: torch.Tensor):
    """x's rows quantized per 32 columns as the bfloat16 kernel does: q = rint(x * (127 / amax)), d = amax / 127."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.tensor(0.0))
    return torch.round(blocks * inv), amax / 127


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_bfloat16_products_are_integer_dot_products_of_int8_activations(qtype):
    """Under bfloat16 activations x is quantized per 32-column block to int8 (llama.cpp's arithmetic): the result
    is the float64 sum over blocks of d_w * d_x * (integer dot product) (+ m * d_x * sum(q_x) for Q4_1), up to
    float32 rounding of each block's terms, and within amax / 254 per column of the exact product."""
    rows, cols = 19, 160
    raw = random_blocks(qtype, rows, cols, seed=2)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = kernels.pack_gguf(torch.from_numpy(raw), qtype.value)
    y = kernels.gguf_matvec(x, packed, qtype.value, rows, None)
    for i in range(6):  # rows go four to a weight load: each row's result is its result alone
        assert torch.equal(y[i], kernels.gguf_matvec(x[i:i + 1], packed, qtype.value, rows, None)[0])
    xq, dx = quantized_rows(x)
    w = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).double().reshape(rows, -1, 32)
    terms = torch.einsum("rbk,mbk->mrb", w, xq.double()) * dx.double()[:, None, :, 0]  # (m, rows, blocks)
    expected = terms.sum(-1)
    bound = 1e-5 * terms.abs().sum(-1) + 2.0 ** -8 * expected.abs()  # float32 sums, then bfloat16 output
    assert ((y.double() - expected).abs() <= bound).all()


def tiny_gguf(tiny_checkpoint, tmp_path, name, **types):
    _, reference = tiny_checkpoint(name)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, reference, arch="qwen2" if name.startswith("qwen2") else "llama", **types)
    return path


MIXED = {"model.layers.0.self_attn.v_proj.weight": Q.Q8_0, "model.layers.1.mlp.up_proj.weight": Q.BF16,
         "model.layers.1.self_attn.o_proj.weight": Q.F16, "model.layers.0.mlp.down_proj.weight": Q.Q5_0,
         "model.embed_tokens.weight": Q.Q4_1}


@needs_kernels
@pytest.mark.parametrize("name,qtype,types", [
    ("llama_tied_gqa", Q.Q8_0, None), ("llama_tied_gqa", Q.Q4_0, None), ("llama", Q.Q4_1, None),
    ("qwen2_sliding", Q.Q4_0, None), ("llama_tied_gqa", Q.Q4_0, MIXED)],
    ids=["Q8_0-tied", "Q4_0-tied", "Q4_1", "Q4_0-qwen2-bias", "mixed"])
def test_logits_match_a_float32_model_of_the_dequantized_weights(tiny_checkpoint, tmp_path, name, qtype, types):
    """Under fp32 the stored blocks give the logits of float32 weights that gguf dequantized, up to float32
    summation order (1e-4 on logits of size ~1), and the same greedy tokens; bfloat16 stays within its rounding.
    The mixed file fuses parts of different types (Q5_0 has no kernel: widened to float32, exactly)."""
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
