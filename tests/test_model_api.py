"""CausalLM's surface: accepted inputs, the decode state, and the errors for everything else."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmstack import (CausalLM, CausalLMState, Checkpoint, CheckpointError, HFConfig, ParallelCausalLM, SafetensorsFile,
                     UnsupportedModel, plan_for)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama_tied_gqa")
    return path, CausalLM.load(path, device="cpu")


def copy_checkpoint(path, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(path, target)
    return target


def test_ids_as_tensor_numpy_or_lists_give_the_same_logits(llama):
    _, lm = llama
    ids = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]
    expected = lm.forward(torch.tensor(ids))
    assert expected.shape == (2, 5, lm.vocab_size) and expected.dtype == torch.float32
    torch.testing.assert_close(lm.forward(np.array(ids, dtype=np.int32)), expected, rtol=0, atol=0)
    torch.testing.assert_close(lm.forward(ids), expected, rtol=0, atol=0)
    torch.testing.assert_close(lm.forward(ids[0]), lm.forward([ids[0]]), rtol=0, atol=0)


@pytest.mark.parametrize("ids, words", [
    (torch.zeros(1, 2, 3, dtype=torch.long), "shape"),
    ([[1, 2], [3]], "rectangular"),
    ([[]], "at least one token"),
    ([[1, 256]], "token id 256"),
    ([[-1, 2]], "token id -1"),
])
def test_bad_ids_are_refused(llama, ids, words):
    _, lm = llama
    with pytest.raises(ValueError, match=words):
        lm.forward(ids)


def test_positions_past_max_positions_are_refused_before_compute(llama):
    path, _ = llama
    lm = CausalLM.load(path, device="cpu", max_positions=8)
    lm.forward(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="max_positions 8"):
        lm.forward(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="max_positions"):
        lm.allocate_state(1, 9)
    state = lm.allocate_state(1, 8)
    lm.forward(torch.zeros(1, 6, dtype=torch.long), state)
    with pytest.raises(ValueError, match="capacity"):
        lm.forward(torch.zeros(1, 3, dtype=torch.long), state)
    assert state.length == 6  # a refused call leaves the state untouched


def test_state_checks(llama, tiny_checkpoint):
    _, lm = llama
    other = CausalLM.load(tiny_checkpoint("llama")[0], device="cpu")
    with pytest.raises(ValueError, match="not allocated by this model"):
        lm.forward([[1, 2]], other.allocate_state(1, 4))
    with pytest.raises(ValueError, match="batch size 2"):
        lm.forward([[1, 2], [3, 4]], lm.allocate_state(1, 4))
    with pytest.raises(ValueError, match="one token per row"):
        lm.step([[1, 2]], lm.allocate_state(1, 4))
    with pytest.raises(ValueError, match="max_tokens"):
        lm.allocate_state(1, 0)


def test_state_is_preallocated_and_reusable(llama):
    _, lm = llama
    ids = torch.randint(0, lm.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    state = lm.allocate_state(2, 9)
    pointers = [(c.k.data_ptr(), c.v.data_ptr()) for c in state.layers]
    first = torch.cat([lm.forward(ids[:, :4], state)] + [lm.step(ids[:, i], state)[:, None] for i in range(4, 9)], 1)
    assert [(c.k.data_ptr(), c.v.data_ptr()) for c in state.layers] == pointers
    assert state.positions.tolist() == [9, 9]
    lm.reset_state(state)
    assert state.length == 0
    torch.testing.assert_close(lm.forward(ids, state), first, rtol=1e-5, atol=1e-5)


def test_generate_prefills_once_then_steps(llama, monkeypatch):
    _, lm = llama
    calls = []
    run = lm._run
    monkeypatch.setattr(lm, "_run", lambda ids, state, last_only=False: calls.append(ids.shape) or
                        run(ids, state, last_only))
    out = lm.generate([[5, 6, 7, 8]], 6)
    assert out.shape == (1, 10)
    assert calls == [(1, 4)] + [(1, 1)] * 5


def test_parameters_by_checkpoint_name_and_unused_names(llama, tmp_path):
    path, lm = llama
    weights = lm.parameters()
    saved = load_file(path / "model.safetensors")
    assert set(weights) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    target = copy_checkpoint(path, tmp_path)
    save_file({**saved, "model.rotary_emb.inv_freq": torch.ones(4)}, target / "model.safetensors")
    assert CausalLM.load(target, device="cpu").unused_names == ["model.rotary_emb.inv_freq"]
    assert "llama" in repr(lm) and "layers=2" in repr(lm)


def test_load_from_an_explicit_safetensors_file(llama):
    path, lm = llama
    other = CausalLM.load(path / "model.safetensors", device="cpu")
    torch.testing.assert_close(other.forward([[1, 2, 3]]), lm.forward([[1, 2, 3]]), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, words", [
    (dict(weight_format="int3"), "weight_format 'int3'"),
    (dict(device="tpu"), "device 'tpu'"),
    (dict(max_positions=0), "max_positions"),
])
def test_bad_load_arguments(llama, kwargs, words):
    path, _ = llama
    with pytest.raises(ValueError, match=words):
        CausalLM.load(path, **{"device": "cpu", **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_gpu_without_cuda_is_refused(llama):
    with pytest.raises(ValueError, match="CUDA is not available"):
        CausalLM.load(llama[0], device="gpu")


def test_shape_mismatch_names_tensor_and_file(llama, tmp_path):
    path, _ = llama
    target = copy_checkpoint(path, tmp_path)
    saved = load_file(target / "model.safetensors")
    saved["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 95)
    save_file(saved, target / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*\[64, 95\]") as e:
        CausalLM.load(target, device="cpu")
    assert "model.safetensors" in str(e.value)


def test_missing_tensor_is_named(llama, tmp_path):
    path, _ = llama
    target = copy_checkpoint(path, tmp_path)
    saved = load_file(target / "model.safetensors")
    del saved["model.norm.weight"]
    save_file(saved, target / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        CausalLM.load(target, device="cpu")


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.norm.weight",
                                  "model.layers.0.input_layernorm.weight"])
def test_non_finite_embedding_norm_or_head_is_refused(llama, tmp_path, name):
    path, _ = llama
    target = copy_checkpoint(path, tmp_path)
    saved = load_file(target / "model.safetensors")
    saved[name][0] = float("nan")
    save_file(saved, target / "model.safetensors")
    with pytest.raises(CheckpointError, match=name):
        CausalLM.load(target, device="cpu")


def test_sharded_index_errors(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama_sharded")
    target = copy_checkpoint(path, tmp_path)
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]

    broken = dict(index, weight_map={**index["weight_map"], "model.norm.weight": shard})
    index_path.write_text(json.dumps(broken))
    with pytest.raises(CheckpointError, match=f"{shard}: lacks tensor 'model.norm.weight'"):
        CausalLM.load(target, device="cpu")

    escaping = dict(index, weight_map={**index["weight_map"], "model.norm.weight": "../elsewhere.safetensors"})
    index_path.write_text(json.dumps(escaping))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        Checkpoint.open(target)

    (target / shard).unlink()
    index_path.write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=shard):
        Checkpoint.open(target)


def test_safetensors_file_info_and_read(llama):
    path, _ = llama
    with SafetensorsFile(path / "model.safetensors") as f:
        info = f.info("model.norm.weight")
        assert (info.dtype, info.shape, info.file) == ("F32", (64,), path / "model.safetensors")
        assert f.read("model.norm.weight").shape == (64,)
        with pytest.raises(KeyError, match="nope"):
            f.info("nope")
    with Checkpoint.open(path) as ckpt:
        assert "model.norm.weight" in ckpt.names()


# ---- the page's generate: "(B, L) ids in, (B, L + max_new_tokens) int32 ids out: the prompt followed by greedy
# continuations ... exactly max_new_tokens are produced per row" (lmstack returns int64, torch's index dtype)

def test_generate_returns_the_prompt_then_the_greedy_continuation(llama):
    _, lm = llama
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    out = lm.generate(ids, 5)
    assert out.shape == (2, 4 + 5) and torch.equal(out[:, :4], ids)
    grown = ids
    for _ in range(5):  # the oracle: argmax of a full forward over the sequence so far
        grown = torch.cat([grown, lm.forward(grown)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, grown)
    assert torch.equal(lm.generate(ids, 5, greedy=True), out)
    assert torch.equal(torch.stack(list(lm.stream(ids, 5)), dim=1), out[:, 4:])  # stream: new tokens only


def test_generate_zero_new_tokens_returns_a_copy_of_the_prompt(llama, monkeypatch):
    _, lm = llama
    ids = torch.tensor([[5, 6, 7]])
    monkeypatch.setattr(lm, "_run", lambda *a, **k: pytest.fail("nothing runs for 0 new tokens"))
    out = lm.generate(ids, 0)
    assert torch.equal(out, ids) and out.data_ptr() != ids.data_ptr()
    assert list(lm.stream(ids, 0)) == []
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate(ids, -1)


def test_greedy_false_without_sampling_options_is_refused_by_name(llama):
    _, lm = llama
    with pytest.raises(ValueError, match="greedy=False"):
        lm.generate([[1, 2]], 3, greedy=False)
    with pytest.raises(ValueError, match="greedy=True"):
        lm.generate([[1, 2]], 3, temperature=0.7)
    with pytest.raises(TypeError, match="greedy"):
        lm.generate([[1, 2]], 3, greedy="yes")
    sampled = lm.generate([[1, 2]], 3, greedy=False, temperature=0.7, seed=0)
    assert sampled.shape == (1, 5) and torch.equal(sampled, lm.generate([[1, 2]], 3, greedy=False, temperature=0.7,
                                                                        seed=0))


def test_generate_past_max_positions_is_refused_before_anything_runs(llama, monkeypatch):
    path, _ = llama
    lm = CausalLM.load(path, device="cpu", max_positions=8)
    assert lm.generate([[1, 2, 3, 4]], 4).shape == (1, 8)  # L + max_new_tokens == max_positions: fits
    monkeypatch.setattr(lm, "_run", lambda *a, **k: pytest.fail("refused before anything runs"))
    for call in (lm.generate, lm.stream):
        with pytest.raises(ValueError, match="prompt length 4 \\+ max_new_tokens 5 exceeds max_positions 8"):
            call([[1, 2, 3, 4]], 5)


def test_ragged_prompts_are_left_padded_with_minus_one(llama):
    _, lm = llama
    out = lm.generate([[1, 2, 3, 4], [5, 6]], 3)
    assert out.shape == (2, 4 + 3)
    assert out[1, :2].tolist() == [-1, -1] and out[1, 2:4].tolist() == [5, 6]
    assert torch.equal(out[1, 2:], lm.generate([[5, 6]], 3)[0])


# ---- the page's small shapes

def test_checkpoint_from_files_weight_map_and_root(tiny_checkpoint):
    """"Checkpoint(files, weight_map, root)": what Checkpoint.open(path) finds, given directly."""
    path, _ = tiny_checkpoint("llama_sharded")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    opened = Checkpoint.open(path)
    with Checkpoint([path / s for s in shards], weight_map, path) as direct:
        assert direct.names() == opened.names() == list(weight_map)
        for name in weight_map:
            assert torch.equal(direct.read(name), opened.read(name))
    single, _ = tiny_checkpoint("llama")
    with Checkpoint([single / "model.safetensors"], None, single) as direct:
        assert direct.names() == Checkpoint.open(single).names()
    with pytest.raises(CheckpointError, match="not one of the checkpoint's files"):
        Checkpoint([path / shards[0]], weight_map, path)


def test_index_naming_a_tensor_its_shard_does_not_hold_is_refused_naming_both(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama_sharded")
    target = copy_checkpoint(path, tmp_path)
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"]["model.layers.9.mlp.extra.weight"] = shard  # a tensor the plan never reads
    index_path.write_text(json.dumps(index))
    for opener in (Checkpoint.open, lambda p: CausalLM.load(p, device="cpu")):
        with pytest.raises(CheckpointError, match=f"lacks tensor 'model.layers.9.mlp.extra.weight'.*{shard}"):
            opener(target)


def test_state_constructible_as_documented_and_reset_returns_it(llama):
    """"CausalLMState(batch_size, max_tokens, layers, *, owner=None)"; "reset_state(state)" returns the state."""
    _, lm = llama
    allocated = lm.allocate_state(2, 6)
    state = CausalLMState(2, 6, allocated.layers, owner=lm)
    assert (state.batch_size, state.max_tokens, state.layers) == (2, 6, allocated.layers)
    assert state.positions.tolist() == [0, 0]
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logits = lm.forward(ids, state)
    torch.testing.assert_close(logits, lm.forward(ids), rtol=1e-5, atol=1e-5)
    assert state.positions.tolist() == [3, 3]
    assert lm.reset_state(state) is state and state.positions.tolist() == [0, 0]
    with pytest.raises(ValueError, match="not allocated by this model"):
        lm.forward(ids, CausalLMState(2, 6, allocated.layers))  # owner=None


def test_step_without_a_state_is_refused_by_name(llama):
    _, lm = llama
    with pytest.raises(ValueError, match="step needs a state"):
        lm.step([1], None)


@pytest.mark.parametrize("ids", [[[1.0, 2.0]], np.array([[1.5]]), torch.tensor([[True]]), [["a", "b"]]])
def test_non_integer_ids_raise_type_error(llama, ids):
    _, lm = llama
    with pytest.raises(TypeError, match="ids must be integers"):
        lm.forward(ids)


def test_max_positions_above_the_config_is_refused_by_name(llama):
    path, lm = llama
    assert lm.max_positions == 128
    with pytest.raises(UnsupportedModel, match="max_positions 129 exceeds the config's max_position_embeddings 128"):
        CausalLM.load(path, device="cpu", max_positions=129)


def test_model_attributes_of_the_page(llama, tiny_checkpoint):
    path, lm = llama
    config = json.loads((path / "config.json").read_text())
    assert lm.config["hidden_size"] == config["hidden_size"] and lm.plan.model_type == "llama"
    assert (lm.d_model, lm.n_layers, lm.kind, lm.vocab_size, lm.max_positions) == (
        config["hidden_size"], config["num_hidden_layers"], "transformer", config["vocab_size"], 128)
    assert lm.norm_eps == config["rms_norm_eps"] and lm.device == torch.device("cpu")
    assert lm.plan.block_kwargs == {}


# ---- the page's constructor: "CausalLM(plan, weights, *, weight_format='float32', max_positions=None,
# device='auto', numeric_profile=None)", weights by checkpoint name

def plan_of(path):
    return plan_for(HFConfig.from_json(path))


@pytest.mark.parametrize("options", [{}, dict(weight_format="bfloat16", numeric_profile="fp32"),
                                     dict(weight_format="int8"), dict(max_positions=16)], ids=str)
def test_built_from_weights_equals_loaded(llama, options):
    path, _ = llama
    loaded = CausalLM.load(path, device="cpu", **options)
    built = CausalLM(plan_of(path), load_file(path / "model.safetensors"), device="cpu", **options)
    ids = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert torch.equal(built.forward(ids), loaded.forward(ids))
    assert (built.weight_format, built.dtype, built.max_positions) == (loaded.weight_format, loaded.dtype,
                                                                       loaded.max_positions)
    assert built.config is None and built.eos_ids == () and built.unused_names == []


def test_built_from_parameters_of_a_trained_model_and_holds_its_own_copy(tiny_checkpoint):
    path, reference = tiny_checkpoint("llama_sharded")
    weights = {name: tensor.clone() for name, tensor in reference.state_dict().items()}  # e.g. after training
    lm = CausalLM(plan_of(path), weights, device="cpu")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    expected = reference(ids).logits
    torch.testing.assert_close(lm.forward(ids), expected, rtol=0, atol=1e-5)
    again = CausalLM(lm.plan, lm.parameters(), device="cpu")
    assert torch.equal(again.forward(ids), lm.forward(ids))
    for tensor in weights.values():
        tensor.zero_()
    torch.testing.assert_close(lm.forward(ids), expected, rtol=0, atol=1e-5)


def load_error(path, tmp_path, change):
    """The message load gives for a checkpoint changed by `change`, and the one the constructor gives."""
    target = copy_checkpoint(path, tmp_path)
    saved = load_file(target / "model.safetensors")
    change(saved)
    save_file(saved, target / "model.safetensors")
    with pytest.raises(CheckpointError) as loaded:
        CausalLM.load(target, device="cpu")
    with pytest.raises(CheckpointError) as built:
        CausalLM(plan_of(target), saved, device="cpu")
    return str(loaded.value), str(built.value)


@pytest.mark.parametrize("change, words", [
    (lambda w: w.pop("model.norm.weight"), "missing tensor 'model.norm.weight'"),
    (lambda w: w.update({"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 95)}),
     "tensor 'model.layers.1.mlp.down_proj.weight' has shape [64, 95], the config implies [64, 96]"),
    (lambda w: w["model.layers.0.input_layernorm.weight"].__setitem__(0, float("inf")),
     "tensor 'model.layers.0.input_layernorm.weight' holds non-finite values"),
    (lambda w: w.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}),
     "tensor 'model.norm.weight' has dtype I32, expected a float dtype"),
], ids=["missing", "shape", "non-finite", "dtype"])
def test_built_from_weights_refuses_as_load_refuses(llama, tmp_path, change, words):
    loaded, built = load_error(llama[0], tmp_path, change)
    assert words in loaded
    assert built.removeprefix("weights: ") == loaded[loaded.index(words):]  # load's words, less its file name


def test_built_from_weights_refuses_what_is_not_a_tensor(llama):
    path, _ = llama
    weights = load_file(path / "model.safetensors")
    with pytest.raises(TypeError, match="weights must map"):
        CausalLM(plan_of(path), list(weights.values()), device="cpu")
    with pytest.raises(TypeError, match=r"weights\['model.norm.weight'\] is a ndarray"):
        CausalLM(plan_of(path), {**weights, "model.norm.weight": np.ones(64)}, device="cpu")
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype torch.complex64"):
        CausalLM(plan_of(path), {**weights, "model.norm.weight": torch.ones(64, dtype=torch.complex64)},
                 device="cpu")
    with pytest.raises(ValueError, match="max_positions 129 exceeds"):
        CausalLM(plan_of(path), weights, device="cpu", max_positions=129)


def test_parallel_built_from_weights(llama):
    path, lm = llama
    weights = load_file(path / "model.safetensors")
    with ParallelCausalLM(plan_of(path), weights, layer_devices=["cpu", "cpu"]) as parallel:
        assert torch.equal(parallel.forward([[1, 2, 3]]), lm.forward([[1, 2, 3]]))
    with pytest.raises(TypeError, match="layer_devices"):
        ParallelCausalLM(plan_of(path), weights, layer_devices=["cpu", "cpu"], device="cpu")
    with pytest.raises(ValueError, match="layer_devices has 1 entries"):
        ParallelCausalLM(plan_of(path), weights, layer_devices=["cpu"])
