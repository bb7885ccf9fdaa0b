"""Resident memory: caches sized for a whole context take pages only as they are written."""

import threading

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
    monkeypatch.setattr(kernels, "gemm_for_prefill", lambda: False)  # F.linear's bands (with AMX)
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


def test_prefault_hands_out_written_memory_in_order_and_frees_what_is_not_kept(monkeypatch):
    monkeypatch.setattr(memory.Prefault, "CHUNK", 1 << 20)
    p = memory.Prefault(64 << 20)
    p.thread.join()
    assert p.written == 64 << 20 and p.held() == 64 << 20
    a, b = p.take(1000), p.take(10)
    start = p.base
    assert torch.frombuffer(a, dtype=torch.uint8).data_ptr() == start
    assert torch.frombuffer(b, dtype=torch.uint8).data_ptr() == start + 1024  # aligned to 64 bytes
    torch.frombuffer(a, dtype=torch.uint8).fill_(3)
    assert bytes(b) == bytes(10) and p.held() == (64 << 20) - 1034
    before = resident()
    p.keep(2 << 20)
    assert before - resident() >= 60 << 20  # the pages past what the load keeps are freed
    assert p.take(3 << 20) is None and p.held() == (2 << 20) - 1034
    assert bytes(a) == b"\x03" * 1000


def test_prefault_keep_does_not_wait_for_a_chunk_being_written(monkeypatch):
    monkeypatch.setattr(memory.Prefault, "CHUNK", 1 << 20)
    memset, inside, go, calls = memory.ctypes.memset, threading.Event(), threading.Event(), []

    def held_memset(address, value, n):  # the tenth chunk stays in memset until told to go on
        calls.append(n)
        if len(calls) == 10:
            inside.set()
            go.wait()
        return memset(address, value, n)

    monkeypatch.setattr(memory.ctypes, "memset", held_memset)
    p = memory.Prefault(64 << 20)
    assert inside.wait(10)
    before = resident()
    keeping = threading.Thread(target=p.keep, args=(2 << 20,), daemon=True)
    keeping.start()
    keeping.join(10)
    assert not keeping.is_alive()  # it returned while the thread was writing
    go.set()
    p.thread.join()
    assert p.written == 2 << 20 and p.take(3 << 20) is None
    assert before - resident() >= 6 << 20  # the thread freed what it had written past the limit


def test_prefault_thread_never_writes_over_what_was_taken(monkeypatch):
    monkeypatch.setattr(memory.Prefault, "CHUNK", 1 << 20)
    for size in (8 << 20, 256 << 20):  # taken behind the thread, and ahead of it
        p = memory.Prefault(size)
        taken = torch.frombuffer(p.take(size // 2), dtype=torch.uint8)
        taken.fill_(7)
        p.thread.join()
        assert bool((taken == 7).all())


def test_a_load_takes_its_packed_blocks_from_the_prefault_and_computes_the_same(tiny_checkpoint, tmp_path):
    from test_gguf import write_gguf

    from lmstack import models

    _, reference = tiny_checkpoint("llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, reference, qtype=Q.Q8_0)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    plain, _ = models.load(str(path), weight_format="gguf", device="cpu")
    p = memory.start_prefault(path.stat().st_size)
    lm, _ = models.load(str(path), weight_format="gguf", device="cpu")
    assert memory._prefault is None  # the load ended it
    blocks = [m.weight for m in [*lm.blocks.modules(), lm.embed] if isinstance(m, GGUFBlocks)]
    assert blocks and all(p.base <= w.data_ptr() < p.base + p.taken for w in blocks)
    assert p.limit == p.taken  # nothing past what the load took is kept
    assert torch.equal(lm.forward(ids), plain.forward(ids))
    p = memory.start_prefault(path.stat().st_size)
    lm, _ = models.load(str(path), weight_format="float32", device="cpu")  # nothing of it as stored
    assert p.taken == p.limit == 0 and torch.allclose(lm.forward(ids), plain.forward(ids), atol=1e-5)


def test_the_command_prefaults_a_gguf_only_where_it_keeps_its_blocks_on_the_cpu(tiny_checkpoint, tmp_path,
                                                                               monkeypatch):
    from test_gguf import write_gguf

    from lmstack import launch

    _, reference = tiny_checkpoint("llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, reference, qtype=Q.Q8_0)
    started = []
    monkeypatch.setattr(memory, "start_prefault", started.append)
    for argv in (["generate", "--model", str(path), "hi"], ["chat", "-m", str(path), "--device", "cpu"],
                 ["serve", f"--model={path}", "--weight-format", "gguf"]):
        launch.prefault_for(argv)
        assert started.pop() == path.stat().st_size, argv
    for argv in ([], ["info", str(path)], ["generate", "hi"], ["generate", "--model", str(tmp_path)],
                 ["generate", "--model", str(path), "--weight-format", "int8"],
                 ["generate", "--model", str(path), "--device", "cuda"], ["generate", "--pipeline", "-m", str(path)],
                 ["generate", "--model", str(tiny_checkpoint("llama")[0] / "config.json")], ["generate", "--model"],
                 ["generate", "--mod", str(path)]):
        launch.prefault_for(argv)
        assert not started, argv
