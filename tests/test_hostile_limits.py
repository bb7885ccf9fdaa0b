"""Hostile checkpoints and configs, round 2: non-finite weights anywhere, files that link out of their
directory, config values that pass a type check but break the arithmetic, headers parsed more than once,
allocations the machine cannot hold. Blow-ups run in a child process (isolated.py)."""

import json
import math
import re
import struct

import gguf
import pytest
import torch

import isolated
import lmstack.checkpoint
import lmstack.memory
from lmstack import CausalLM, CheckpointError, ConfigError, TokenizerError, models
from lmstack.config import HFConfig, plan_for
from test_hostile import CONFIG, byte_tokenizer_json, checkpoint_dir, gguf_file, tensors

V = CONFIG["vocab_size"]

# ---- class 3: non-finite weights, wherever they are ------------------------------------------------


@pytest.mark.parametrize("name, dtype", [("model.layers.0.self_attn.q_proj.weight", torch.float32),
                                         ("model.layers.0.mlp.down_proj.weight", torch.float32),
                                         ("model.layers.0.mlp.down_proj.weight", torch.bfloat16),
                                         ("model.layers.0.mlp.up_proj.weight", torch.float16),
                                         ("model.layers.0.self_attn.k_proj.weight", torch.bfloat16)])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("weight_format", ["float32", "bfloat16"])
def test_non_finite_weight_anywhere_is_refused_naming_file_and_tensor(tmp_path, name, dtype, value, weight_format):
    """Read converted a slice at a time, straight into place where the file's dtype is the one stored, or (a
    bfloat16 matrix stored as bfloat16) straight into the kernels' tiles."""
    weights = tensors()
    weights[name] = weights[name].to(dtype)
    weights[name][-1, -1] = value  # the last element: the check must cover every slice
    root = checkpoint_dir(tmp_path, weights=weights)
    with pytest.raises(CheckpointError) as caught:
        CausalLM.load(root, device="cpu", weight_format=weight_format)
    assert str(root / "model.safetensors") in str(caught.value) and repr(name) in str(caught.value)
    assert "non-finite" in str(caught.value)


def test_non_finite_weight_in_a_weights_dict_is_refused_by_name():
    weights = tensors()
    name = "model.layers.0.self_attn.o_proj.weight"
    weights[name][1, 2] = math.nan
    plan = plan_for(HFConfig(dict(CONFIG)))
    with pytest.raises(CheckpointError, match=f"weights: tensor '{name}' holds non-finite"):
        CausalLM(plan, weights, device="cpu")


def test_non_finite_gguf_weight_is_refused_naming_file_and_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    gguf_file(path)
    data = bytearray(path.read_bytes())
    from lmstack.gguf import GGUFHeader
    with GGUFHeader(path) as f:
        t = f.tensors["blk.0.ffn_down.weight"]
    struct.pack_into("<f", data, t.offset + 12, math.nan)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' holds "
                                              r"non-finite"):
        CausalLM.load(path, device="cpu")


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F16],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("weight_format, profile, mmap", [("float32", None, True), ("gguf", None, True),
                                                         ("gguf", "bf16", True), ("gguf", "bf16", False)])
def test_non_finite_gguf_float_weight_is_refused_naming_file_and_tensor(tmp_path, qtype, weight_format, profile,
                                                                        mmap):
    """A BF16 or F16 matrix is read as it is stored (not through gguf's dequantize; under gguf a BF16 one left in
    the file's mapping, or with mmap=False read straight into tiles): the check still sees it."""
    name = "model.layers.0.mlp.up_proj.weight"
    weights = tensors()
    weights[name][-1, -1] = math.nan
    path = tmp_path / "m.gguf"
    gguf_file(path, weights=weights, types={name: qtype})
    with pytest.raises(CheckpointError, match=rf"m\.gguf: tensor '{re.escape(name)}' holds non-finite"):
        CausalLM.load(path, device="cpu", weight_format=weight_format, numeric_profile=profile, mmap=mmap)


def test_finite_weights_load_exactly(tmp_path):
    """The check reads what it copies: the loaded weights are the file's, to the bit."""
    weights = tensors()
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].half()
    root = checkpoint_dir(tmp_path, weights=weights)
    loaded = CausalLM.load(root, device="cpu").parameters()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor.float()), name


def test_finite_float32_weight_that_overflows_bfloat16_storage_is_refused_by_name(tmp_path):
    """3.4e38 is a finite float32 but beyond bfloat16's largest value (3.39e38)."""
    weights = tensors()
    name = "model.layers.0.mlp.gate_proj.weight"
    weights[name][0, 0] = 3.4e38
    root = checkpoint_dir(tmp_path, weights=weights)
    with pytest.raises(CheckpointError, match=rf"{name}.*overflow to inf when stored as bfloat16"):
        CausalLM.load(root, device="cpu", weight_format="bfloat16")
    assert CausalLM.load(root, device="cpu").parameters()[name][0, 0] == 3.4e38  # float32 holds it


# ---- class 6: one symlink rule for every file of a checkpoint ---------------------------------------


def test_model_safetensors_linking_out_of_the_directory_is_refused(tmp_path):
    outside = checkpoint_dir(tmp_path / "outside")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG))
    (root / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.safetensors' lies outside the checkpoint directory"):
        CausalLM.load(root, device="cpu")
    inside = checkpoint_dir(tmp_path / "inside")  # a link that stays inside is followed, as for shards
    (inside / "model.safetensors").rename(inside / "blob")
    (inside / "model.safetensors").symlink_to("blob")
    CausalLM.load(inside, device="cpu")


# ---- class 7: config values in range, quoted short ---------------------------------------------------

INF = float("inf")
VALUES = [
    ("rope_theta", INF, "'rope_theta'"), ("rope_theta", 1e-320, "'rope_theta'"), ("rope_theta", 0.5, "'rope_theta'"),
    ("rms_norm_eps", 1e308, "'rms_norm_eps'"), ("rms_norm_eps", 1e-320, "'rms_norm_eps'"),
    ("rms_norm_eps", INF, "'rms_norm_eps'"),
    ("eos_token_id", 2**63, "eos_token_id = 9223372036854775808"), ("eos_token_id", V, f"eos_token_id = {V}"),
    ("eos_token_id", -1, "eos_token_id = -1"), ("eos_token_id", "2", "eos_token_id = '2'"),
    ("eos_token_id", [1, "x"], "eos_token_id = [1, 'x']"), ("eos_token_id", True, "eos_token_id = True"),
    ("eos_token_id", 2.0, "eos_token_id = 2.0"),
]


@pytest.mark.parametrize("key, value, words", VALUES, ids=[f"{k}={v!r}" for k, v, _ in VALUES])
def test_config_values_that_break_the_arithmetic_are_refused(tmp_path, key, value, words):
    root = checkpoint_dir(tmp_path, config={**CONFIG, key: value})
    with pytest.raises(ConfigError) as caught:
        CausalLM.load(root, device="cpu")
    assert str(root / "config.json") in str(caught.value) and words in str(caught.value)


@pytest.mark.parametrize("key, value", [("rope_theta", 1.0), ("rope_theta", 1e6), ("rms_norm_eps", 1e-5),
                                        ("eos_token_id", [0, V - 1])])
def test_config_values_at_the_edges_of_the_ranges_load(tmp_path, key, value):
    CausalLM.load(checkpoint_dir(tmp_path, config={**CONFIG, key: value}), device="cpu")


def test_eos_ids_of_generation_config_are_checked_too(tmp_path):
    root = checkpoint_dir(tmp_path)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1 << 63]}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id"):
        CausalLM.load(root, device="cpu")
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, V - 1]}))
    assert CausalLM.load(root, device="cpu").eos_ids == (2, V - 1)


@pytest.mark.parametrize("key", ["hidden_act", "model_type", "rope_theta"])
def test_a_huge_value_is_quoted_short(tmp_path, key):
    root = checkpoint_dir(tmp_path, config={**CONFIG, key: "x" * 10_000_000})
    with pytest.raises(ValueError) as caught:
        CausalLM.load(root, device="cpu")
    assert len(str(caught.value)) < 1000 and "10000002 characters" in str(caught.value)


def test_a_tokenizer_with_ids_past_the_model_vocabulary_is_refused(tmp_path):
    root = checkpoint_dir(tmp_path)  # 32 ids; the tokenizer has 257
    (root / "tokenizer.json").write_text(byte_tokenizer_json())
    with pytest.raises(TokenizerError, match=f"tokenizer.json: token id 256 is past the model's vocab_size {V}"):
        models.load(str(root), device="cpu")
    spec = json.loads(byte_tokenizer_json())
    spec["added_tokens"][0]["id"] = 4_000_000
    (root / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError):
        models.load(str(root), device="cpu")


# ---- class 5: allocations the machine cannot hold refused by size, before allocating ---------------


def load_path(path):
    CausalLM.load(path, device="cpu")
    return "loaded"


def sparse_checkpoint(root, hidden=4096, vocab=1 << 21):
    """A valid checkpoint of a 32 GB embedding, written as a sparse file: nothing allocated to build it."""
    config = dict(CONFIG, hidden_size=hidden, vocab_size=vocab, num_attention_heads=32, intermediate_size=16,
                  tie_word_embeddings=True)
    kv = hidden // 32
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "model.layers.0.input_layernorm.weight": (hidden,),
              "model.layers.0.post_attention_layernorm.weight": (hidden,),
              "model.layers.0.self_attn.q_proj.weight": (hidden, hidden),
              "model.layers.0.self_attn.k_proj.weight": (kv, hidden),
              "model.layers.0.self_attn.v_proj.weight": (kv, hidden),
              "model.layers.0.self_attn.o_proj.weight": (hidden, hidden),
              "model.layers.0.mlp.gate_proj.weight": (16, hidden), "model.layers.0.mlp.up_proj.weight": (16, hidden),
              "model.layers.0.mlp.down_proj.weight": (hidden, 16)}
    header, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    with open(root / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + at)


def state_of(steps):
    """A tiny model without max_position_embeddings asked for a decode state (or a generation) of `steps`."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        config = {k: v for k, v in CONFIG.items() if k != "max_position_embeddings"}
        lm = CausalLM.load(checkpoint_dir(Path(tmp), config=config), device="cpu")
    if steps[0] == "state":
        lm.allocate_state(1, steps[1])
    else:
        lm.generate([[1, 2]], max_new_tokens=steps[1])


def test_allocations_the_machine_cannot_hold_are_refused_by_size(tmp_path):
    sparse_checkpoint(tmp_path / "sparse")
    outcomes = isolated.run((__name__, "load_path", str(tmp_path / "sparse")),
                            (__name__, "state_of", ["state", 10**9]), (__name__, "state_of", ["generate", 10**9]))
    for result in outcomes:
        assert result["error"] == "MemoryError", result
        assert "GiB" in result["message"] and "available" in result["message"], result
    assert "llama weights as float32 needs 32." in outcomes[0]["message"]
    assert "decode state of 1 x 1000000000" in outcomes[1]["message"]


def test_the_memory_check_counts_weights_as_they_are_stored(tmp_path, monkeypatch):
    """bfloat16 storage under float32 arithmetic keeps 2 bytes a weight (only a layer's float32 copy at a time
    exists while loading): a machine with room for that, not for float32, loads it and refuses float32 by size."""
    weights = tensors()
    blocks = sum(t.numel() for name, t in weights.items() if name.startswith("model.layers."))
    embed = weights["model.embed_tokens.weight"].numel()
    root = checkpoint_dir(tmp_path, weights=weights)
    monkeypatch.setattr(lmstack.memory, "available", lambda device: 2 * 4 * embed + 3 * blocks)
    assert CausalLM.load(root, device="cpu", weight_format="bfloat16").weight_format == "bfloat16"
    with pytest.raises(MemoryError, match="llama weights as float32 needs"):
        CausalLM.load(root, device="cpu")


# ---- class 5: each safetensors header parsed once ---------------------------------------------------


def test_each_safetensors_header_is_parsed_once_per_load(tmp_path):
    """Reads use the header parsed on open: the `safetensors` library re-parsed it on every read (a 95 MB
    header cost ~4 s a tensor), which a header overwritten after opening would make fail."""
    root = checkpoint_dir(tmp_path)
    path = root / "model.safetensors"
    with lmstack.checkpoint.Checkpoint.open(root) as checkpoint:
        with open(path, "r+b") as fh:
            fh.seek(8)
            fh.write(b"X" * 16)  # no longer JSON
        for name in checkpoint.names():
            dest = torch.empty(checkpoint.info(name).shape)
            checkpoint.read_into(name, dest)
            assert torch.equal(dest, tensors()[name]), name


def big_header(root):
    """A valid checkpoint whose header also lists 400,000 zero-size tensors (a ~30 MB header)."""
    weights = tensors()
    weights.update({f"pad.{i}": torch.zeros(0) for i in range(400_000)})
    checkpoint_dir(root, weights=weights)


def test_a_huge_header_of_empty_tensors_loads_within_the_limit(tmp_path):
    big_header(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").stat().st_size > 20 << 20
    result = isolated.run((__name__, "load_path", str(tmp_path / "ckpt")), seconds=90)[0]
    assert result["error"] is None, result


def test_a_safetensors_file_cut_short_after_it_was_opened_is_refused_by_name(tmp_path):
    root = checkpoint_dir(tmp_path)
    path = root / "model.safetensors"
    with lmstack.checkpoint.Checkpoint.open(root) as checkpoint:
        name = max(checkpoint.names(), key=lambda n: math.prod(checkpoint.info(n).shape))
        with open(path, "r+b") as fh:
            fh.truncate(8)  # the header, parsed on open, gone too
        with pytest.raises(CheckpointError, match=f"model.safetensors: tensor {name!r} cannot be read: the file "
                                                  f"was cut short"):
            checkpoint.read_into(name, torch.empty(checkpoint.info(name).shape))
