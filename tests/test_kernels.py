"""lmstack's CPU kernels against the PyTorch operators they stand in for, on awkward shapes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmstack import CausalLM, kernels
from lmstack.formats import MatvecLinear, PackedLinear
from lmstack.rope import apply_rotary


def cpu_has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512_bf16" in cpuinfo.read_text()


def test_kernels_run_wherever_the_cpu_can():
    """On a CPU with AVX512-BF16 a failed build must fail here, not fall back unnoticed."""
    if not cpu_has_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16: PyTorch's operators run instead")
    assert kernels.available()


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="lmstack's CPU kernels cannot run here")
generator = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(shape, generator=generator).to(dtype)


def assert_rounded_once(out, exact):
    """out is exact (float64) rounded to out's dtype, give or take float32 summation order."""
    scale = float(exact.abs().max())
    tolerance = exact.abs() * (2**-8 if out.dtype == torch.bfloat16 else 2**-20) + scale * 1e-6
    assert ((out.double() - exact).abs() <= tolerance).all(), float((out.double() - exact).abs().max())


SHAPES = [(1, 960, 576), (3, 13, 37), (8, 7, 100), (2, 5, 1), (1, 9, 33)]  # (rows of x, out, in)


@needs_kernels
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tiled", [False, True])
def test_matvec_bf16(m, n, k, with_bias, tiled):
    x, w, b = randn(m, k), randn(n, k), randn(n) if with_bias else None
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    if tiled:
        weight = kernels.tile_int8(w)
        assert torch.equal(kernels.untile_int8(weight, n, k), w)
        out = kernels.matvec_bf16_tiled(x, weight, n, b)
    else:
        out = kernels.matvec_bf16(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_rounded_once(out, exact)


@needs_kernels
@pytest.mark.parametrize("n, k", [(13, 37), (24, 576), (9, 1100), (16, 2080), (8, 2100), (150, 2080)])
@pytest.mark.parametrize("tiled", [False, True])
def test_matvec_bf16_gives_a_row_alone_its_bits_in_any_batch(n, k, tiled):
    """An engine step's rows (up to 16 share each pass over the weights, more in groups; from 64 rows the tiled
    weights go by panels, 150 x 2080: two, in chunks of columns): each row's result is the bits it gets alone,
    whatever its batch-mates, and x @ w.T rounded once."""
    x, w, b = randn(200, k), randn(n, k), randn(n)
    x[3], b[0] = 0, 2.0**-130  # a sum that is a bfloat16 subnormal, which the output keeps
    weight = kernels.tile_int8(w) if tiled else w
    matvec = (lambda x, b: kernels.matvec_bf16_tiled(x, weight, n, b)) if tiled else \
        (lambda x, b: kernels.matvec_bf16(x, weight, b))
    alone = torch.cat([matvec(x[i:i + 1], b) for i in range(len(x))])
    assert_rounded_once(alone, x.double() @ w.double().T + b.double())
    assert alone[3, 0] == b[0] != 0
    for m in (2, 3, 4, 5, 8, 15, 16, 17, 20, 63, 64, 65, 181, 200):
        assert torch.equal(matvec(x[:m], b), alone[:m]), m
    unbiased = torch.cat([matvec(x[i:i + 1], None) for i in range(3, 200)])
    assert torch.equal(matvec(x[3:200], None), unbiased)


@needs_kernels
@pytest.mark.parametrize("m, n, k", [(40, 70, 100), (13, 33, 2050), (1, 8, 2), (530, 40, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_bf16_multiplies_the_weights_as_stored(m, n, k, with_bias):
    """Many rows (a prefill) on the tiles (gemm_bf16_tiled) or the rows as they are (gemm_bf16_rows): every row
    block, column block (2050: two; 100: a ragged last one) and panel edge, and the weights themselves (times the
    identity each output is one product: the weight's bits); the two give the same bits."""
    x, w, b = randn(m, k), randn(n, k), randn(n) if with_bias else None
    weight = kernels.tile_int8(w)
    out = kernels.gemm_bf16_tiled(x, weight, n, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_rounded_once(out, x.double() @ w.double().T + (0 if b is None else b.double()))
    assert torch.equal(kernels.gemm_bf16_rows(x, w, b), out)
    identity = torch.eye(k, dtype=torch.bfloat16)
    assert torch.equal(kernels.gemm_bf16_tiled(identity, weight, n, None).T, w)
    assert torch.equal(kernels.gemm_bf16_rows(identity, w, None).T, w)


@needs_kernels
@pytest.mark.parametrize("m, n, k", [(40, 70, 100), (13, 33, 530), (1, 8, 3), (530, 40, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("weight_dtype, tiled", [(torch.bfloat16, True), (torch.bfloat16, False),
                                                  (torch.float32, False)])
def test_float32_gemm_multiplies_the_exact_weights(m, n, k, with_bias, weight_dtype, tiled):
    """Many rows of float32 x (a prefill in the fp32 profile) on bfloat16 tiles (gemm_f32_tiled) or a bfloat16 or
    float32 matrix as it is (gemm_f32_rows): times the identity each output is the weight, exactly; otherwise
    within float32's bound of the exact product (a sum per block of 256 columns: 530, three) and about as near it
    as F.linear. Every row block, panel edge and ragged last block of columns."""
    own = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=own), torch.randn(n, k, generator=own).to(weight_dtype)
    b = torch.randn(n, generator=own) if with_bias else None
    if tiled:
        weight = kernels.tile_int8(w)
        gemm = lambda x, b: kernels.gemm_f32_tiled(x, weight, n, b)
    else:
        gemm = lambda x, b: kernels.gemm_f32_rows(x, w, b)
    assert torch.equal(gemm(torch.eye(k), None).T, w.float())
    y = gemm(x, b)
    bias = torch.zeros(n, dtype=torch.float64) if b is None else b.double()
    exact = x.double() @ w.double().T + bias
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + bias.abs()) * 1.01
    assert y.shape == (m, n) and y.dtype == torch.float32 and ((y.double() - exact).abs() <= bound).all()
    error = lambda t: (t.double() - exact).abs().mean() / exact.abs().mean()
    assert error(y) <= 2 * error(torch.nn.functional.linear(x, w.float(), b))


@needs_kernels
@pytest.mark.parametrize("m, n, k", [(40, 70, 100), (13, 33, 530), (1, 8, 3), (530, 40, 64)])
def test_float32_gemm_on_int8_tiles(m, n, k):
    """Many rows of float32 x on matvec_int8's weights (an int8 prefill in the fp32 profile): (x @ q.T) * scales +
    bias, q widened exactly (times the identity, each output is q * scale), within float32's bound otherwise."""
    own = torch.Generator().manual_seed(m + n * k)
    x, b, scales = torch.randn(m, k, generator=own), torch.randn(n, generator=own), torch.rand(n, generator=own)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=own)
    q[0, :3] = torch.tensor([-127, 127, -1], dtype=torch.int8)  # each byte's sign kept
    tiled = kernels.tile_int8(q)
    assert torch.equal(kernels.gemm_f32_int8_tiled(torch.eye(k), tiled, scales, None).T, q.float() * scales[:, None])
    y = kernels.gemm_f32_int8_tiled(x, tiled, scales, b)
    exact = (x.double() @ q.double().T) * scales.double() + b.double()
    bound = (k + 2) * 2.0 ** -24 * ((x.double().abs() @ q.double().abs().T) * scales.double() + b.double().abs())
    assert y.shape == (m, n) and y.dtype == torch.float32 and ((y.double() - exact).abs() <= bound * 1.01).all()


@needs_kernels
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matvec_int8(m, n, k, dtype):
    x, b = randn(m, k, dtype=dtype), randn(n, dtype=dtype)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand(n, generator=generator) / 100
    exact = (x.double() @ w.double().T) * scales.double() + b.double()
    tiled = kernels.tile_int8(w)
    assert torch.equal(kernels.untile_int8(tiled, n, k), w)
    out = kernels.matvec_int8(x, tiled, scales, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_rounded_once(out, exact)


@needs_kernels
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_matvec_f32(m, n, k, weight_dtype):
    """float32 activations: bfloat16 weights widened exactly; float32 ones summed in float64, so each output
    is the exact result rounded once."""
    own = torch.Generator().manual_seed(m * n * k)
    x, w, b = (torch.randn(shape, generator=own) for shape in [(m, k), (n, k), (n,)])
    w = w.to(weight_dtype)
    exact = x.double() @ w.double().T + b.double()
    out = kernels.matvec_f32(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    if weight_dtype == torch.float32:
        assert torch.equal(out, exact.float())
    assert_rounded_once(out, exact)


DTYPES = [torch.bfloat16, torch.float32]


def assert_close_to_reference(out, reference, exact_fraction):
    """Equal to the reference but for rare one-ulp roundings of a different float32 summation order."""
    assert (out == reference).float().mean() >= exact_fraction
    torch.testing.assert_close(out, reference, rtol=2**-7 if out.dtype == torch.bfloat16 else 1e-6, atol=1e-30)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 7, 24), (5, 1)])
def test_rms_norm_rounds_as_the_reference(shape, dtype):
    x, w = randn(*shape, dtype=dtype) * 3, randn(shape[-1], dtype=dtype)
    out = kernels.rms_norm(x, w, 1e-5)
    if dtype == torch.float32:  # more accurate than the reference: the normalized x is rounded once, then w * it
        exact = w.double() * F.rms_norm(x.double(), w.shape, eps=1e-5)
        assert ((out.double() - exact).abs() <= exact.abs() * 2**-22 + 2**-147).all()  # two roundings
        return
    reference = w * F.rms_norm(x.float(), w.shape, eps=1e-5).to(dtype)
    assert_close_to_reference(out, reference, 0.98)


@needs_kernels
def test_kernels_take_strided_views():
    """As q_norm does: the q heads of a (B, L, heads, D) qkv tensor."""
    qkv, w = randn(2, 3, 10, 24), randn(24)
    heads = qkv[:, :, :4]
    assert not heads.is_contiguous()
    assert torch.equal(kernels.rms_norm(heads, w, 1e-5), kernels.rms_norm(heads.contiguous(), w, 1e-5))
    x, weight = randn(6, 5).T, randn(3, 6)
    assert torch.equal(kernels.matvec_bf16(x, weight, None), kernels.matvec_bf16(x.contiguous(), weight, None))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_into_cache_equals_rotary_and_cache_writes(head_dim, dtype):
    B, L, H, KV, T, start = 2, 3, 6, 2, 10, 4
    qkv = randn(B, L, H + 2 * KV, head_dim, dtype=dtype)
    angles = torch.rand(B, L, 1, head_dim, generator=generator) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache, v_cache = randn(B, KV, T, head_dim, dtype=dtype), randn(B, KV, T, head_dim, dtype=dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    rotated = apply_rotary(qkv[:, :, :H + KV], cos, sin)
    expected_k[:, :, start:start + L] = rotated[:, :, H:].transpose(1, 2)
    expected_v[:, :, start:start + L] = qkv[:, :, H + KV:].transpose(1, 2)

    q = kernels.rope_into_cache(qkv, cos, sin, k_cache, v_cache, start)
    assert torch.equal(q, rotated[:, :, :H])  # the reference's roundings, bit for bit
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, length, scale", [
    (6, 2, 64, 1, None), (6, 2, 24, 17, None), (4, 4, 32, 40, None), (3, 1, 64, 200, None), (9, 3, 64, 1000, None),
    (8, 1, 80, 600, None), (4, 1, 16, 40, 24 ** -0.5)])  # (Gemma's query_pre_attn_scalar: a scale of its own)
def test_decode_attention_equals_sdpa(heads, kv_heads, head_dim, length, scale, dtype):
    """Long contexts are split into chunks of keys whose partial softmaxes are merged: 600 and 1000 keys take
    several, and eight q heads sharing one kv head take two passes."""
    B, T = 2, length + 10
    q = randn(B, 1, heads, head_dim, dtype=dtype)
    k_cache, v_cache = randn(B, kv_heads, T, head_dim, dtype=dtype) * 2, randn(B, kv_heads, T, head_dim, dtype=dtype)
    k, v = k_cache[:, :, :length].double(), v_cache[:, :, :length].double()
    exact = F.scaled_dot_product_attention(q.double().transpose(1, 2), k, v, enable_gqa=heads != kv_heads,
                                           scale=None if scale is None else float(torch.tensor(scale)))
    out = kernels.decode_attention(q, k_cache, v_cache, length, scale)
    assert out.shape == (B, 1, heads * head_dim) and out.dtype == dtype
    assert_rounded_once(out, exact.transpose(1, 2).reshape(B, 1, -1))


def on_one_thread(call):
    """call() with PyTorch's thread count set to 1."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return call()
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_does_not_depend_on_the_thread_count(dtype):
    q, k_cache, v_cache = randn(2, 1, 9, 64, dtype=dtype), randn(2, 3, 1100, 64, dtype=dtype), randn(2, 3, 1100, 64,
                                                                                                   dtype=dtype)
    alone = on_one_thread(lambda: kernels.decode_attention(q, k_cache, v_cache, 1030))
    assert torch.equal(kernels.decode_attention(q, k_cache, v_cache, 1030), alone)


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, head_dim, length, start", [
    (9, 3, 64, 100, 0), (4, 4, 32, 37, 0), (2, 1, 128, 70, 5), (6, 2, 64, 300, 0)])
def test_prefill_attention_equals_sdpa_within_bfloat16_rounding(heads, kv_heads, head_dim, length, start):
    """Causal attention of many queries (rows past a task's 8, keys past a block's 32, positions after a cached
    prefix): each output within its own rounding and its probabilities' rounding to bfloat16 of float64 SDPA, and
    on the whole no further from it than PyTorch's bfloat16 SDPA, which rounds them too."""
    B, T, S = 2, start + length + 7, start + length
    q = randn(B, length, heads, head_dim)
    k_cache, v_cache = randn(B, kv_heads, T, head_dim) * 2, randn(B, kv_heads, T, head_dim)
    k_cache[:, :, S:] = v_cache[:, :, S:] = float("nan")  # slots past the prompt are never read
    mask = torch.ones(length, S, dtype=torch.bool).tril(start)
    k, v, gqa = k_cache[:, :, :S], v_cache[:, :, :S], heads != kv_heads
    exact = F.scaled_dot_product_attention(q.double().transpose(1, 2), k.double(), v.double(), attn_mask=mask,
                                           enable_gqa=gqa).transpose(1, 2).reshape(B, length, -1)
    reference = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask if start else None,
                                               is_causal=not start, enable_gqa=gqa)
    reference = reference.transpose(1, 2).reshape(B, length, -1)
    out = kernels.prefill_attention(q, k_cache, v_cache, start)
    assert out.shape == (B, length, heads * head_dim) and out.dtype == torch.bfloat16
    error = (out.double() - exact).abs()
    assert (error <= exact.abs() * 2**-8 + float(v.abs().max()) * 2**-8).all()
    assert error.mean() <= 1.5 * (reference.double() - exact).abs().mean()


@needs_kernels
def test_prefill_attention_does_not_depend_on_the_thread_count():
    q, k_cache, v_cache = randn(1, 203, 9, 64), randn(1, 3, 210, 64), randn(1, 3, 210, 64)
    alone = on_one_thread(lambda: kernels.prefill_attention(q, k_cache, v_cache, 0))
    assert torch.equal(kernels.prefill_attention(q, k_cache, v_cache, 0), alone)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (3, 2, 2 * 37)])
def test_silu_mul_rounds_as_the_reference(shape, dtype):
    gate_up = randn(*shape, dtype=dtype) * 4
    gate_up.view(-1)[:4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernels.silu_mul(gate_up)
    if dtype == torch.float32:  # silu computed in float64 and rounded once, then times up
        exact = F.silu(gate.double()) * up.double()
        assert ((out.double() - exact).abs() <= exact.abs() * 2**-22 + 2**-147).all()  # two roundings
        return
    # exp within an ulp or two of PyTorch's: a rare rounding flip in bfloat16
    assert_close_to_reference(out, F.silu(gate) * up, 0.98)


@needs_kernels
def test_silu_mul_follows_the_reference_past_exps_range():
    """Gates far below zero: e^-g past float32's range is inf in PyTorch, so silu is -0.0, not a tiny value; just
    inside it, the tiny value the reference gives."""
    gate = torch.tensor([-88.5, -88.75, -89.0, -92.0, -100.0, -120.0, -1000.0, -88.0] * 2, dtype=torch.bfloat16)
    up = torch.full_like(gate, 2.0)
    out, reference = kernels.silu_mul(torch.cat([gate, up])[None])[0], F.silu(gate) * up
    assert torch.equal(out[1:7], reference[1:7]) and str(out[1:7].tolist()) == str(reference[1:7].tolist())
    assert torch.allclose(out[[0, 7]].float(), reference[[0, 7]].float(), rtol=2**-7, atol=0)


@needs_kernels
def test_bad_operands_are_refused_by_name():
    with pytest.raises(RuntimeError, match="x has 5 columns, w has 6"):
        kernels.matvec_bf16(randn(1, 5), randn(3, 6), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous bfloat16 vector of 3"):
        kernels.matvec_bf16(randn(1, 6), randn(3, 6), randn(4))
    with pytest.raises(RuntimeError, match="matvec_f32: x must be a float32 CPU tensor"):
        kernels.matvec_f32(randn(1, 6), randn(3, 6), None)
    with pytest.raises(RuntimeError, match="matvec_f32: bias must be a contiguous float32 vector of 3"):
        kernels.matvec_f32(randn(1, 6, dtype=torch.float32), randn(3, 6), randn(3))
    with pytest.raises(RuntimeError, match=r"w must be int8 tiled as \(1, 1, 8, 32\)"):
        kernels.matvec_int8(randn(1, 6), torch.zeros(3, 6, dtype=torch.int8), torch.ones(3), None)
    with pytest.raises(RuntimeError, match="weight has 7 entries for rows of 8"):
        kernels.rms_norm(randn(2, 8), randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="slots 9..11 outside a cache of 10"):
        kernels.rope_into_cache(randn(1, 2, 4, 8), randn(1, 2, 1, 8), randn(1, 2, 1, 8), randn(1, 1, 10, 8),
                                randn(1, 1, 10, 8), 9)
    with pytest.raises(RuntimeError, match="rms_norm: weight must be a contiguous 1-D Float CPU tensor"):
        kernels.rms_norm(randn(2, 8, dtype=torch.float32), randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul: x must be float32 or bfloat16, got Half"):
        kernels.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="length 11 outside a cache of 10"):
        kernels.decode_attention(randn(1, 1, 2, 8), randn(1, 1, 10, 8), randn(1, 1, 10, 8), 11)
    with pytest.raises(RuntimeError, match=r"positions 0..11 outside a cache of 10"):
        kernels.prefill_attention(randn(1, 11, 2, 32), randn(1, 1, 10, 32), randn(1, 1, 10, 32), 0)
    with pytest.raises(RuntimeError, match="head dim a multiple of 32"):
        kernels.prefill_attention(randn(1, 3, 2, 24), randn(1, 1, 10, 24), randn(1, 1, 10, 24), 0)


@needs_kernels
@pytest.mark.parametrize("variant, weight_format, profile", [
    ("llama_bias", "bfloat16", "bf16"), ("qwen3", "bfloat16", "bf16"), ("llama_tied_gqa", "bfloat16", "bf16"),
    ("llama_bias", "int8", "bf16"), ("llama_tied_gqa", "int8", "bf16"), ("llama_bias", "bfloat16", None),
    ("llama_tied_gqa", "int8", None), ("qwen3", "float32", None), ("llama_tied_gqa", "float32", None)])
def test_a_model_decodes_alike_with_and_without_the_kernels(tiny_checkpoint, monkeypatch, variant, weight_format,
                                                            profile):
    """The kernels and PyTorch's operators differ only in float32 summation order."""
    path, _ = tiny_checkpoint(variant)
    ids = torch.randint(0, 256, (2, 9), generator=generator)

    def decode(lm):
        state = lm.allocate_state(2, 16)
        steps = [lm.forward(ids, state)[:, -1]] + [lm.step(ids[:, i:i + 1], state).reshape(2, -1) for i in range(4)]
        return torch.stack(steps).float()

    fast = CausalLM.load(path, weight_format=weight_format, numeric_profile=profile, device="cpu")
    with_kernels = decode(fast)
    monkeypatch.setattr(kernels, "available", lambda: False)
    plain = CausalLM.load(path, weight_format=weight_format, numeric_profile=profile, device="cpu")
    down = fast.blocks[0].mlp.down, plain.blocks[0].mlp.down
    if weight_format == "float32":
        assert isinstance(down[0], MatvecLinear) and down[0].kernel and not down[1].kernel
    elif weight_format == "bfloat16" and profile == "bf16":
        assert isinstance(down[0], MatvecLinear) and isinstance(down[1], PackedLinear)
    else:
        assert down[0].kernel and not down[1].kernel
        assert torch.equal(fast.parameters()["model.layers.0.mlp.down_proj.weight"],
                           plain.parameters()["model.layers.0.mlp.down_proj.weight"])  # the same stored values
    without = decode(plain)
    delta = float((with_kernels - without).abs().max() / without.abs().max())
    print(f"{variant} {weight_format}/{profile or 'fp32'}: max |delta logit| / scale with and without the kernels "
          f"= {delta:.3g}")
    assert delta < (0.03 if profile == "bf16" else 1e-5)


@needs_kernels
def test_a_bfloat16_prefill_attends_through_the_prefill_kernel(tiny_checkpoint, monkeypatch):
    """A bf16 prompt from slot 0 with heads of 64 takes prefill_attention in every layer, and its logits are
    PyTorch's path's (SDPA, F.linear) up to bfloat16 rounding."""
    path, _ = tiny_checkpoint("llama_wide")
    lm = CausalLM.load(path, weight_format="bfloat16", numeric_profile="bf16", device="cpu")
    ids = torch.randint(0, 256, (2, 40), generator=generator)
    calls, kernel = [], kernels.prefill_attention
    monkeypatch.setattr(kernels, "prefill_attention", lambda *args: calls.append(args) or kernel(*args))
    fast = lm.forward(ids, lm.allocate_state(2, 48)).float()
    assert len(calls) == len(lm.blocks)
    monkeypatch.setattr(kernels, "gemm_for_prefill", lambda: False)
    plain = lm.forward(ids, lm.allocate_state(2, 48)).float()
    assert len(calls) == len(lm.blocks)
    assert float((fast - plain).abs().max() / plain.abs().max()) < 0.03


@needs_kernels
def test_a_cached_build_is_loaded_as_it_is_only_while_it_was_made_from_these_sources():
    """A build whose fingerprint matches is loaded without cpp_extension (which re-checks it with ninja); one made
    from other sources (or flags) goes through cpp_extension, which rebuilds what changed, and gets a new one."""
    child = ("import sys; from lmstack import kernels; assert kernels.available(); "
             "print('torch.utils.cpp_extension' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def checked_by_cpp_extension() -> bool:
        done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip() == "True"

    stamp = kernels.build_directory() / "fingerprint"
    assert stamp.read_text() == kernels.fingerprint()
    assert not checked_by_cpp_extension()
    stamp.write_text("a fingerprint of other sources")
    assert checked_by_cpp_extension()
    assert stamp.read_text() == kernels.fingerprint()


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    kernels.remove_stale_lock(lock)
    assert lock.exists()
    old = time.time() - kernels.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="kernels build that stopped"):
        kernels.remove_stale_lock(lock)
    assert not lock.exists()
    kernels.remove_stale_lock(lock)  # nothing left to remove


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_all_finite_agrees_with_isfinite_wherever_the_bad_value_lies(dtype):
    """Split over threads and chunks: a bad value in the first, a middle or the last element (of a length no chunk
    divides) is seen; the largest finite value, subnormals and -0 are not bad."""
    x = randn(3 * (1 << 16) + 4099, dtype=dtype)
    info = torch.finfo(dtype)
    x[:4] = torch.tensor([info.max, -info.max, info.smallest_normal / 4, -0.0])
    assert kernels.all_finite(x) and bool(torch.isfinite(x).all())
    for value in (float("inf"), float("-inf"), float("nan")):
        for at in (0, x.numel() // 2 + 1, x.numel() - 1):
            bad = x.clone()
            bad[at] = value
            assert not kernels.all_finite(bad), (value, at)
    strided = x.clone()
    strided[-1] = float("nan")  # an even index (the length is odd): inside the view below, which is not contiguous
    assert not kernels.all_finite(strided[::2]) and kernels.all_finite(x[::2])


@needs_kernels
@pytest.mark.parametrize("n, k", [(64, 2048), (13, 100), (40, 48)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_matvec_f32_tiled_sums_as_matvec_f32_does(n, k, m):
    """bfloat16 weights in tile_int8's tiles, widened to float32: every row of a whole tile summed as matvec_f32
    sums it untiled (bit for bit); the rows of a last, partial tile within float32 rounding; the bias added."""
    w, x, bias = randn(n, k), randn(m, k, dtype=torch.float32), randn(n, dtype=torch.float32)
    tiled = kernels.matvec_f32_tiled(x, kernels.tile_int8(w), n, bias)
    untiled = kernels.matvec_f32(x, w, bias)
    whole = n // kernels.TILE * kernels.TILE
    assert torch.equal(tiled[:, :whole], untiled[:, :whole])
    torch.testing.assert_close(tiled, untiled, rtol=1e-6, atol=1e-5)
    assert_rounded_once(tiled, x.double() @ w.double().T + bias.double())
