"""Resident memory: caches sized for a whole context take pages only as they are written."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_blocks import random_blocks

from lmstack import CausalLM, formats, kernels, memory
from lmstack.formats import GGUFBlocks


def resident() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def test_zeros_are_zeros_resident_only_where_written():
    before = resident()
    t = memory.zeros((256, 1024, 128), torch.bfloat16, "cpu")  # 64 MiB
    assert t.shape == (256, 1024, 128) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert resident() - before < 8 << 20
    t[:16] = 1.5  # 4 MiB written
    assert 4 << 20 <= resident() - before < 16 << 20
    assert bool((t[16:] == 0).all()) and bool((t[:16] == 1.5).all())
    assert memory.zeros((3, 5), torch.float32, "cpu").equal(torch.zeros(3, 5))


def test_kv_pool_and_state_take_memory_as_they_fill(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama")
    lm = CausalLM.load(path, device="cpu")
    before = resident()
    pages = lm.allocate_pages(4096, 16)  # 2 layers x (k, v) x 4096 x 4 heads x 16 x 16 x float32 = 64 MiB
    state = lm.allocate_state(64, 128)  # 2 x 2 x 64 x 4 x 128 x 16 x 4 = 8 MiB
    assert resident() - before < 8 << 20
    assert all(bool((p.k == 0).all()) and bool((p.v == 0).all()) for p in pages)
    assert all(bool((layer.k == 0).all()) for layer in state.layers)


@pytest.mark.skipif(not kernels.available(), reason="lmstack's CPU kernels do not run here")
@pytest.mark.parametrize("profile", [torch.float32, torch.bfloat16])
def test_a_prefill_dequantizes_a_band_of_rows_at_a_time_with_the_same_result(profile, monkeypatch):
    """Over GGUF_KERNEL_ROWS rows GGUFBlocks multiplies dequantized weights: bands of 16 rows (not whole tiles of
    the matrix's 37) give the products of the whole matrix dequantized."""
    raw = random_blocks(Q.Q8_0, 37, 64, seed=3)
    blocks = GGUFBlocks(torch.from_numpy(raw), Q.Q8_0.value, 64)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(0)).to(profile)
    w = blocks.dense(dtype=profile)
    expected = torch.nn.functional.linear(x, w)
    monkeypatch.setattr(formats, "GGUF_DENSE_BYTES", 16 * 64 * x.element_size())
    y = blocks(x)
    assert y.shape == expected.shape and y.dtype == profile
    # the same products, summed in another order at most: within 64 roundings of sum |x w|
    bound = 64 * torch.finfo(profile).eps * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - expected.double()).abs() <= bound).all()
