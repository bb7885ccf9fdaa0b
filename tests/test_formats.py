"""Weight formats and numeric profiles: what each stores, how close its numbers stay, what is refused."""

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lmstack import CausalLM, UnsupportedModel, kernels
from lmstack.formats import INT4_GROUP, Int4Linear, Int8Linear, MatvecLinear, resolve


def relative_delta(out, ref):
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama_bias")  # biases: the quantized modules must carry them
    return path, CausalLM.load(path, device="cpu")


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("weight_format, profile, module, tolerance", [
    ("bfloat16", None, MatvecLinear, 1e-2),
    ("bfloat16", "bf16", MatvecLinear, 3e-2),
    ("int8", None, Int8Linear, 5e-2),
    ("int8", "bf16", Int8Linear, 5e-2),
    ("int4", None, Int4Linear, 3e-1),
    ("int4", "bf16", Int4Linear, 3e-1),
])
def test_formats_stay_close_to_float32(llama, weight_format, profile, module, tolerance):
    path, reference = llama
    lm = CausalLM.load(path, weight_format=weight_format, numeric_profile=profile, device="cpu")
    assert isinstance(lm.blocks[0].attn.qkv, module)
    assert (lm.weight_format, lm.numeric_profile) == (weight_format, profile or "fp32")  # as resolved
    dtype = torch.bfloat16 if profile == "bf16" else torch.float32  # the arithmetic's, whatever the storage
    assert lm.embed.dtype == lm.head_projection.weight.dtype == lm.norm.weight.dtype == dtype
    delta = relative_delta(lm.forward(IDS), reference.forward(IDS))
    print(f"{weight_format}/{profile or 'default'}: max |delta logit| / scale = {delta:.3g}")
    assert delta < tolerance
    assert lm.generate(IDS, 4).shape == (2, IDS.shape[1] + 4)


def test_bfloat16_storage_holds_the_checkpoints_values_rounded_once(llama):
    """Under float32 arithmetic a float32 checkpoint's projections are read straight into bfloat16 (never filled in
    float32 first): every part of a fused projection holds its values as .to(bfloat16) rounds them, and the rest
    (embedding, head, norms, biases) stays exact."""
    path, reference = llama
    stored = CausalLM.load(path, weight_format="bfloat16", device="cpu").parameters()
    projections = 0
    for name, weight in reference.parameters().items():
        projection = name.startswith("model.layers.") and name.endswith("proj.weight")
        projections += projection
        expected = weight.bfloat16().float() if projection else weight
        assert torch.equal(stored[name].float(), expected), name
    assert projections >= 7


@pytest.mark.parametrize("kernels_on", [True, False])
def test_bfloat16_storage_computes_in_float32_by_default(tiny_checkpoint, monkeypatch, kernels_on):
    """On a bfloat16 checkpoint, weight_format='bfloat16' stores the very values float32 holds: under the default
    profile the logits, prefill and decode, differ from float32's only by float32 summation order."""
    if not kernels_on:
        monkeypatch.setattr(kernels, "available", lambda: False)
    path, _ = tiny_checkpoint("llama_bf16")
    models = {name: CausalLM.load(path, weight_format=fmt, numeric_profile=profile, device="cpu")
              for name, fmt, profile in [("float32", "float32", None), ("bfloat16", "bfloat16", None),
                                         ("bf16 arithmetic", "bfloat16", "bf16")]}
    assert models["bfloat16"].blocks[0].mlp.down.weight.dtype == torch.bfloat16  # stored as bfloat16
    assert models["bfloat16"].blocks[0].mlp.down.kernel == kernels_on
    assert models["bfloat16"].blocks[0].attn.qkv.tiled == kernels_on  # read from the file into the kernels' tiles

    def logits(lm):
        state = lm.allocate_state(2, 20)
        steps = [lm.forward(IDS, state)] + [lm.step(IDS[:, i], state)[:, None] for i in range(4)]
        return torch.cat(steps, dim=1)

    expected = logits(models["float32"])
    deltas = {name: relative_delta(logits(lm), expected) for name, lm in models.items() if name != "float32"}
    print(f"kernels {'on' if kernels_on else 'off'}: max |delta logit| / scale against float32: {deltas}")
    assert deltas["bfloat16"] < 1e-6  # float32 rounding: a few ulps of the logit scale
    assert deltas["bf16 arithmetic"] > 1e-3  # the explicit choice does change the arithmetic


def test_int8_weights_are_within_half_a_step_of_the_originals(llama):
    path, reference = llama
    lm = CausalLM.load(path, weight_format="int8", device="cpu")
    original, dequantized = reference.parameters(), lm.parameters()
    assert set(original) == set(dequantized)
    for name in (n for n in original if n.endswith("proj.weight")):
        w = original[name]
        step = w.abs().amax(dim=1, keepdim=True) / 127
        assert ((dequantized[name] - w).abs() <= step * (0.5 + 2**-8)).all(), name  # bf16 scales
    assert lm.blocks[0].mlp.down.weight.dtype == torch.int8
    assert lm.embed.dtype == torch.float32 and lm.norm.weight.dtype == torch.float32  # floating point stays


def test_int4_groups_are_within_half_a_step(llama):
    path, reference = llama
    lm = CausalLM.load(path, weight_format="int4", device="cpu")
    w = reference.parameters()["model.layers.0.mlp.down_proj.weight"]
    groups = w.reshape(w.shape[0], -1, INT4_GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (lm.parameters()["model.layers.0.mlp.down_proj.weight"] - w).abs().reshape(groups.shape)
    assert (error <= step[..., None] * (0.5 + 2**-7) + 1e-3).all()  # the kernel's bfloat16 output


@pytest.mark.skipif(not kernels.available(), reason="the int4 dequantizer is one of lmstack's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [192, 960, 48])  # 64-row blocks, and one block of row pairs
def test_int4_many_rows_multiply_the_weights_pytorch_int4_kernel_uses(n, dtype):
    """A prefill's rows go through one GEMM on the weights dequantized from PyTorch's packed layout: the very
    values its int4 kernel multiplies (to one rounding of dtype), and the same products up to summation order.
    In float32, with 64-row blocks, lmstack's GEMM dequantizes a panel at a time: the same values exactly."""
    torch.manual_seed(n)
    linear = nn.Linear(96, n)
    module = Int4Linear(linear, dtype)
    assert module.dequantizes
    unit = torch.eye(96, dtype=dtype)
    theirs, ours = module._matmul(unit).float(), module._dequantized(dtype).float()
    step = 2 ** -23 if dtype == torch.float32 else 2 ** -8
    assert ((ours - theirs).abs() <= step * theirs.abs() + 1e-30).all()
    if dtype == torch.float32 and n % 64 == 0:
        assert torch.equal(kernels.gemm_f32_int4pack(unit, module.weight, module.scales_zeros, n, None), ours)
    x = torch.randn(40, 96, dtype=dtype)
    many, few = module(x), torch.cat([module(x[i:i + 8]) for i in range(0, 40, 8)])  # 40 rows: dequantized
    assert relative_delta(many.float(), few.float()) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_an_int4_packed_layout_read_wrong_keeps_pytorch_int4_kernel(monkeypatch):
    """The packed layout is PyTorch's, no public contract: where the dequantizer's values are not its kernel's
    (here: a dequantizer that reads it all wrong), every row goes through PyTorch's kernel."""
    monkeypatch.setattr(kernels, "int4pack_dequantize_t", lambda packed, sz, n, k, dtype: torch.ones(k, n, dtype=dtype))
    module = Int4Linear(nn.Linear(64, 96), torch.bfloat16)
    assert not module.dequantizes
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    assert torch.equal(module(x), module._matmul(x) + module.bias)


@pytest.mark.parametrize("weight_format, profile, words", [
    ("int3", None, "weight_format 'int3'"),
    ("float32", "fp16", "numeric_profile 'fp16'"),
    ("float32", "bf16", "numeric_profile 'bf16' is not available with weight_format 'float32'"),
])
def test_unknown_or_unavailable_pairs_are_refused_by_name(weight_format, profile, words):
    with pytest.raises(ValueError, match=words):
        resolve(weight_format, profile)


def test_refusal_comes_before_any_weight_is_read(tmp_path, llama):
    (tmp_path / "config.json").write_bytes((llama[0] / "config.json").read_bytes())
    save_file({"unrelated": torch.zeros(1)}, tmp_path / "model.safetensors")  # reading a weight would fail
    with pytest.raises(ValueError, match="numeric_profile 'fp64'"):
        CausalLM.load(tmp_path, numeric_profile="fp64", device="cpu")


def test_int4_is_refused_for_recurrent_models(tmp_path):
    config = dict(model_type="mamba", hidden_size=32, num_hidden_layers=2, vocab_size=64, state_size=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"unrelated": torch.zeros(1)}, tmp_path / "model.safetensors")  # reading a weight would fail
    with pytest.raises(UnsupportedModel, match="weight_format 'int4'.*mamba"):
        CausalLM.load(tmp_path, weight_format="int4", device="cpu")


def test_int8_greedy_text_leaves_float32_only_at_near_ties(smollm2_hf):
    """int8 moves logits by a few tenths: it may flip a near-tie, never a confident choice, and it keeps
    the first 16 greedy tokens of most prompts."""
    from lmstack import Tokenizer

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are",
               "To make a cup of tea,", "The largest planet in the solar system is", "import numpy as np\n",
               "Water boils at", "The theory of relativity was developed by", "In 1492, Columbus",
               "A haiku about autumn:\n", "The quick brown fox", "Photosynthesis is the process",
               "SELECT * FROM users WHERE", "The best way to learn a language is", "Dear Sir or Madam,",
               "The mitochondria is", "Here is a recipe for pancakes:", "The stock market", "My favorite book is"]
    tokenizer = Tokenizer.from_pretrained(smollm2_hf)
    base = CausalLM.load(smollm2_hf, device="cpu")
    int8 = CausalLM.load(smollm2_hf, weight_format="int8", device="cpu")
    same = 0
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        expected, got = base.generate([ids], 16)[0, len(ids):], int8.generate([ids], 16)[0, len(ids):]
        if torch.equal(expected, got):
            same += 1
            continue
        first = int((expected != got).nonzero()[0])
        logits = base.forward([ids + expected[:first].tolist()])[0, -1]
        top2 = logits.topk(2).values
        print(f"{prompt!r}: int8 leaves float32 at token {first}, where float32's top-2 margin is "
              f"{float(top2[0] - top2[1]):.3f}")
        assert top2[0] - top2[1] < 0.5
    print(f"int8 greedy text equal to float32 for 16 tokens on {same} of {len(prompts)} prompts")
    assert same > len(prompts) / 2


def test_int4_widths_are_checked_before_any_weight_is_read(tmp_path, llama):
    config = json.loads((llama[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    save_file({"unrelated": torch.zeros(1)}, tmp_path / "model.safetensors")  # reading a weight would fail
    with pytest.raises(ValueError, match="intermediate_size divisible by 32, got 100"):
        CausalLM.load(tmp_path, weight_format="int4", device="cpu")
