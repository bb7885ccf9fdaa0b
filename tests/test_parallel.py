"""ParallelCausalLM and PipelineCausalLM compute CausalLM's numbers; bad layer splits are refused up front.

Run as a script under torchrun, this file is the pipeline test's worker (one process per rank).
"""

import subprocess
import sys
import threading

import pytest
import torch

from lmstack import CausalLM
from lmstack.checkpoint import SafetensorsFile
from lmstack.parallel import ParallelCausalLM, PipelineCausalLM

IDS = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])


def resident_bytes(lm) -> int:
    """Bytes of the weights this model holds in memory (each storage once, meta placeholders excluded)."""
    tensors = [*lm.blocks.parameters(), *lm.norm.parameters(), lm.embed, lm.head]
    return sum(t.nbytes for t in {t.data_ptr(): t for t in tensors if not t.is_meta}.values())


@pytest.mark.parametrize("name", ["llama_tied_gqa", "qwen2_sliding"])
def test_cpu_layer_devices_give_causal_lm_logits_states_and_tokens(tiny_checkpoint, name):
    path, _ = tiny_checkpoint(name)
    reference = CausalLM.load(path, device="cpu")
    with ParallelCausalLM.load(path, layer_devices=["cpu"] * reference.plan.n_layers) as lm:
        assert torch.equal(lm.forward(IDS), reference.forward(IDS))
        ours, theirs = lm.allocate_state(2, 10), reference.allocate_state(2, 10)
        assert torch.equal(lm.forward(IDS, ours), reference.forward(IDS, theirs))
        assert torch.equal(lm.step([7, 8], ours), reference.step([7, 8], theirs))
        assert ours.length == theirs.length == 7
        for ours, theirs in zip(ours.layers, theirs.layers):
            assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)
        assert torch.equal(lm.generate(IDS, 8), reference.generate(IDS, 8))


def test_a_split_between_device_objects_moves_activations_and_copies_a_tied_head(tiny_checkpoint):
    # torch keeps "cpu" and "cpu:0" apart as devices, so the CPU exercises the path between real devices.
    path, _ = tiny_checkpoint("qwen2_sliding")
    reference = CausalLM.load(path, device="cpu")
    with ParallelCausalLM.load(path, layer_devices=["cpu", "cpu:0", "cpu:0"]) as lm:
        assert lm.head is not lm.embed and torch.equal(lm.head, lm.embed)
        assert lm.layer_devices == [torch.device("cpu"), torch.device("cpu", 0), torch.device("cpu", 0)]
        assert torch.equal(lm.forward(IDS), reference.forward(IDS))
        assert torch.equal(lm.generate(IDS, 8), reference.generate(IDS, 8))


@pytest.mark.parametrize("layer_devices, message", [
    (["cpu"] * 3, "layer_devices has 3 entries, the checkpoint has 2 layers"),
    (["cpu"], "layer_devices has 1 entries"),
    ("cpu", "layer_devices must be a list"),
    (["cpu", "tpu"], "layer_devices[1]"),
    (["cpu", "auto"], "layer_devices[1] = 'auto'"),
    ([True, "cpu"], "layer_devices[0] = True"),
    (["cpu", -1], "layer_devices[1]"),
    pytest.param([0, "cpu"], "layer_devices[0]: device 'cuda:0': CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")),
])
def test_invalid_layer_devices_are_refused_by_name_before_weights_are_read(tiny_checkpoint, monkeypatch,
                                                                            layer_devices, message):
    path, _ = tiny_checkpoint("llama_tied_gqa")

    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before layer_devices was checked")

    monkeypatch.setattr(SafetensorsFile, "read", no_reads)
    with pytest.raises(ValueError) as refused:
        ParallelCausalLM.load(path, layer_devices=layer_devices)
    assert message in str(refused.value)


def test_close_releases_the_weights_and_a_closed_model_refuses(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama_tied_gqa")
    with ParallelCausalLM.load(path, layer_devices=["cpu", "cpu"]) as lm:
        lm.forward(IDS)
    assert lm.closed and lm.parameters() == {} and lm.embed is None
    assert lm.blocks is None and lm.norm is None and lm.head_projection is None
    for use in (lambda: lm.forward(IDS), lambda: lm.generate(IDS, 2), lambda: lm.allocate_state(1, 4)):
        with pytest.raises(RuntimeError, match="closed: its weights were released"):
            use()
    lm.close()  # closing twice is harmless


def test_a_second_thread_is_refused_while_a_call_runs(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("llama_tied_gqa")
    lm = ParallelCausalLM.load(path, layer_devices=["cpu", "cpu"])
    inside, release = threading.Event(), threading.Event()
    block = lm.blocks[1]
    original = block.forward

    def held(*args):
        inside.set()
        release.wait(30)
        return original(*args)

    monkeypatch.setattr(block, "forward", held)
    worker = threading.Thread(target=lm.forward, args=(IDS,))
    worker.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="running a call in another thread"):
            lm.forward(IDS)
    finally:
        release.set()
        worker.join(30)
    monkeypatch.setattr(block, "forward", original)
    lm.forward(IDS)  # free again once the first call is done


def test_pipeline_over_two_gloo_processes_matches_one_process(tiny_checkpoint, tmp_path):
    # qwen2_sliding: 3 layers, tied head, sliding windows; rank 0 gets layer 0, rank 1 layers 1-2.
    path, _ = tiny_checkpoint("qwen2_sliding")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, str(path), str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    reference = CausalLM.load(path, device="cpu")
    assert torch.equal(ranks[0]["tokens"], reference.generate(IDS, 8))
    assert torch.equal(ranks[0]["ragged"], reference.generate([[1, 2, 3, 4], [5, 6]], 5))
    torch.testing.assert_close(ranks[0]["logits"], reference.forward(IDS), rtol=0, atol=1e-6)

    layer = [sum(p.nbytes for p in block.parameters()) for block in reference.blocks]
    embed, norm = reference.embed.nbytes, reference.norm.weight.nbytes
    assert [r["layers"] for r in ranks] == [[0], [1, 2]]
    assert ranks[0]["bytes"] == embed + layer[0]
    assert ranks[1]["bytes"] == layer[1] + layer[2] + norm + embed  # the tied head, copied to the last rank
    assert all(name.startswith("model.layers.0.") or name == "model.embed_tokens.weight"
               for name in ranks[0]["names"])
    assert not any(name.startswith("model.layers.0.") for name in ranks[1]["names"])
    assert "rank 1: the model runs on rank 0 only" in ranks[1]["refused"]


def _pipeline_worker(path, out):
    """One rank of test_pipeline_over_two_gloo_processes_matches_one_process."""
    with PipelineCausalLM.load(path, device="cpu") as lm:
        result = {"layers": list(lm.layers), "bytes": resident_bytes(lm), "names": sorted(lm.parameters())}
        if lm.rank == 0:
            result["tokens"] = lm.generate(IDS, 8)
            result["ragged"] = lm.generate([[1, 2, 3, 4], [5, 6]], 5)
            result["logits"] = lm.forward(IDS)
        else:
            try:
                lm.forward(IDS)
            except RuntimeError as e:
                result["refused"] = str(e)
            lm.serve()
        torch.save(result, f"{out}/rank{lm.rank}.pt")


if __name__ == "__main__":
    _pipeline_worker(*sys.argv[1:3])
