"""Resident memory: caches sized for a whole context take pages only as they are written."""

import torch

from lmstack import CausalLM, memory


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
