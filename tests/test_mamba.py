"""Mamba 1 and Mamba 2 against transformers' torch path, on tiny random checkpoints built in the same run."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from lmstack import CausalLM, ConfigError, HFConfig, UnsupportedModel, plan_for

BASE = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, initializer_range=0.1)

# name -> (transformers config class, overrides): chunk sizes that the test lengths are not multiples of
VARIANTS = {
    "mamba": ("MambaConfig", dict(state_size=8)),
    "mamba_untied_bias": ("MambaConfig", dict(state_size=4, conv_kernel=3, time_step_rank=5, use_bias=True,
                                              use_conv_bias=False, tie_word_embeddings=False,
                                              residual_in_fp32=False, num_hidden_layers=3)),
    "mamba2": ("Mamba2Config", dict(num_heads=8, head_dim=8, n_groups=1, state_size=16, chunk_size=8)),
    "mamba2_groups_tied": ("Mamba2Config", dict(num_heads=4, head_dim=16, n_groups=2, state_size=8, chunk_size=5,
                                                expand=2, use_bias=True, tie_word_embeddings=True,
                                                residual_in_fp32=False)),
    "mamba2_dt_limit": ("Mamba2Config", dict(num_heads=8, head_dim=12, expand=3, n_groups=4, state_size=8,
                                             chunk_size=16, conv_kernel=2, time_step_limit=(0.01, 0.05))),
}


def _perturb(model):
    """Random init leaves norms and D at 1 and biases at 0; move them so a misapplied one shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".D"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias") and "dt" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> (path, transformers reference in float32); built once per module."""
    root, cache = tmp_path_factory.mktemp("mamba"), {}

    def get(name):
        if name not in cache:
            config_cls, overrides = VARIANTS[name]
            torch.manual_seed(sum(map(ord, name)))
            config = getattr(transformers, config_cls)(**{**BASE, **overrides})
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
            _perturb(model)
            model.save_pretrained(root / name)
            reference = transformers.AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32).eval()
            cache[name] = root / name, reference
        return cache[name]

    return get


def worst_delta(out, ref):
    return float((out - ref).abs().max())


def ids_for(shape, seed):
    return torch.randint(0, BASE["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("length", [1, 19, 150])  # 150: several scan chunks and SSD spans
def test_float32_logits_match_transformers(checkpoint, name, length):
    path, reference = checkpoint(name)
    lm = CausalLM.load(path, device="cpu")
    ids = ids_for((2, length), 0)
    with torch.no_grad():
        expected = reference(ids).logits
    delta = worst_delta(lm.forward(ids), expected)
    print(f"{name} L={length}: worst |delta logit| = {delta:.2e} (logit scale {float(expected.abs().max()):.1f})")
    assert delta <= 1e-4


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prefills_then_steps_equal_one_forward(checkpoint, name):
    path, _ = checkpoint(name)
    lm = CausalLM.load(path, device="cpu")
    ids = ids_for((3, 40), 1)
    full = lm.forward(ids)
    state = lm.allocate_state(3)  # no max_tokens: a recurrent state does not grow
    pieces = [lm.forward(ids[:, :13], state), lm.forward(ids[:, 13:30], state)]
    pieces += [lm.step(ids[:, i], state)[:, None] for i in range(30, 40)]
    assert state.length == 40
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    lm.reset_state(state)  # a reused state starts from zeros again
    torch.testing.assert_close(lm.forward(ids[:, :7], state), full[:, :7], rtol=1e-5, atol=1e-5)


# mamba2_dt_limit is left out: transformers' one-token decode path skips the time_step_limit clamp
# that its prefill applies (lmstack clamps in both), so its greedy tokens are not a reference there.
@pytest.mark.parametrize("name", sorted(set(VARIANTS) - {"mamba2_dt_limit"}))
def test_greedy_generate_matches_transformers(checkpoint, name):
    path, reference = checkpoint(name)
    lm = CausalLM.load(path, device="cpu")
    ids = ids_for((2, 5), 2)
    reference.generation_config.eos_token_id = None  # run all 32 tokens; suppressing EOS would bias it
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                  do_sample=False, pad_token_id=0)
    assert expected.shape[1] == ids.shape[1] + 32
    assert torch.equal(lm.generate(ids, 32), expected)


@pytest.mark.parametrize("name", ["mamba", "mamba2_groups_tied"])
def test_ragged_rows_generate_as_they_would_alone(checkpoint, name):
    path, _ = checkpoint(name)
    lm = CausalLM.load(path, device="cpu")
    rows = [ids_for((9,), 3).tolist(), ids_for((4,), 4).tolist()]
    together = lm.generate(rows, 12)
    for i, row in enumerate(rows):
        assert torch.equal(together[i, 9 - len(row):], lm.generate([row], 12)[0])


@pytest.mark.parametrize("name", ["mamba_untied_bias", "mamba2", "mamba2_groups_tied"])
def test_bfloat16_matches_transformers_bfloat16(checkpoint, name):
    path, _ = checkpoint(name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    lm = CausalLM.load(path, weight_format="bfloat16", numeric_profile="bf16", device="cpu")
    mixer = lm.blocks[0].mixer
    assert mixer.A_log.dtype == mixer.D.dtype == lm.blocks[0].norm.weight.dtype == torch.float32
    assert mixer.in_proj.weight.dtype == torch.bfloat16
    ids = ids_for((2, 19), 3)
    with torch.no_grad():
        expected = reference(ids).logits.float()
    delta = worst_delta(lm.forward(ids), expected) / max(1.0, float(expected.abs().max()))
    print(f"{name} bfloat16: worst |delta logit| / scale = {delta:.2e}")
    assert delta <= 2e-2


PROJECTIONS = {"mamba1": ("in_proj", "x_proj", "dt_proj", "out_proj"), "mamba2": ("in_proj", "out_proj")}


@pytest.mark.parametrize("name", ["mamba", "mamba_untied_bias", "mamba2", "mamba2_groups_tied"])
@pytest.mark.parametrize("weight_format, profile", [("bfloat16", None), ("int8", None), ("int8", "bf16")])
def test_low_bit_projections_against_transformers_on_the_same_weights(checkpoint, name, weight_format, profile):
    """The projections are stored in the format; A_log, D, the conv, the norms and the scan stay float32. The
    oracle is transformers in float32 on the very weights lmstack holds (dequantized), so in the fp32 profile
    only float32 rounding separates them (1e-4, as for float32 checkpoints) and greedy tokens are equal; the
    bf16 profile rounds activations to bfloat16 (2e-2 of the logit scale, as against transformers' bfloat16)."""
    path, original = checkpoint(name)
    lm = CausalLM.load(path, weight_format=weight_format, numeric_profile=profile, device="cpu")
    assert (lm.weight_format, lm.numeric_profile) == (weight_format, profile or "fp32")
    mixer = lm.blocks[0].mixer
    stored = torch.int8 if weight_format == "int8" else torch.bfloat16
    assert all(getattr(mixer, p).weight.dtype == stored for p in PROJECTIONS[lm.plan.kind])
    assert mixer.A_log.dtype == mixer.D.dtype == lm.blocks[0].norm.weight.dtype == torch.float32
    assert mixer.conv1d.weight.dtype == (torch.bfloat16 if profile else torch.float32)

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    held = {k: v.float() for k, v in lm.parameters().items()}
    missing = set(held) - set(reference.state_dict())
    assert not missing, missing
    reference.load_state_dict(held, strict=False)
    ids = ids_for((2, 19), 6)
    with torch.no_grad():
        expected, unquantized = reference(ids).logits, original(ids).logits
    out = lm.forward(ids)
    scale = float(expected.abs().max())
    print(f"{name} {weight_format}/{profile or 'fp32'}: worst |delta logit| {worst_delta(out, expected):.2e} against "
          f"transformers on the same weights, {worst_delta(out, unquantized):.2e} against the float32 weights "
          f"(logit scale {scale:.1f})")
    if profile:
        assert worst_delta(out, expected) <= 2e-2 * scale
        return
    assert worst_delta(out, expected) <= 1e-4
    reference.generation_config.eos_token_id = None
    greedy = reference.generate(ids[:, :5], attention_mask=torch.ones_like(ids[:, :5]), max_new_tokens=16,
                                do_sample=False, pad_token_id=0)
    ours = lm.generate(ids[:, :5], 16)
    assert torch.equal(ours, greedy)
    original.generation_config.eos_token_id = None
    unquantized = original.generate(ids[:, :5], attention_mask=torch.ones_like(ids[:, :5]), max_new_tokens=16,
                                    do_sample=False, pad_token_id=0)
    same = (ours == unquantized).all(dim=1)
    print(f"greedy tokens equal to the float32 weights' on {int(same.sum())} of 2 rows")
    if weight_format == "bfloat16":  # bfloat16 rounding moves no greedy token here; int8's step may flip a near-tie
        assert same.all()


def test_mamba_ssm_format_config_is_mapped(checkpoint, tmp_path):
    """An original mamba_ssm checkpoint: no model_type, ssm_cfg, padded vocabulary, `embedding` not `embeddings`."""
    path, reference = checkpoint("mamba2_groups_tied")
    weights = load_file(path / "model.safetensors")
    weights["backbone.embedding.weight"] = weights.pop("backbone.embeddings.weight")
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(dict(
        d_model=32, d_intermediate=0, n_layer=2, vocab_size=250, pad_vocab_size_multiple=16,
        ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=16, ngroups=2, chunk_size=5, bias=True),
        attn_layer_idx=[], attn_cfg={}, rms_norm=True, residual_in_fp32=False, fused_add_norm=True,
        tie_embeddings=True)))
    lm = CausalLM.load(tmp_path, device="cpu")
    assert (lm.plan.model_type, lm.vocab_size) == ("mamba2", 256)
    ids = ids_for((2, 19), 5)
    with torch.no_grad():
        expected = reference(ids).logits
    assert worst_delta(lm.forward(ids), expected) <= 1e-4

    mamba1 = plan_for(dict(d_model=64, n_layer=3, vocab_size=50277, ssm_cfg={}))
    assert (mamba1.kind, mamba1.vocab_size, mamba1.block_options["dt_rank"]) == ("mamba1", 50280, 4)
    assert mamba1.tie_embeddings and mamba1.max_position_embeddings is None


MAMBA2 = dict(model_type="mamba2", hidden_size=32, num_hidden_layers=2, vocab_size=256, num_heads=8, head_dim=8,
              n_groups=2)
SSM = dict(d_model=32, n_layer=2, vocab_size=256)


@pytest.mark.parametrize("config, error, words", [
    (dict(MAMBA2, model_type="mamba", hidden_act="gelu"), UnsupportedModel, "hidden_act = 'gelu'"),
    (dict(MAMBA2, hidden_act="relu"), UnsupportedModel, "hidden_act = 'relu'"),
    (dict(MAMBA2, rms_norm=False), UnsupportedModel, "rms_norm = False"),
    (dict(MAMBA2, num_heads=6), ConfigError, "'num_heads' = 6"),
    (dict(MAMBA2, n_groups=3), ConfigError, "'n_groups' = 3"),
    (dict(MAMBA2, time_step_limit=[0.1, 0.01]), ConfigError, "'time_step_limit'"),
    (dict(MAMBA2, chunk_size=0), ConfigError, "'chunk_size' = 0"),
    (dict(MAMBA2, model_type="mamba", time_step_rank="half"), ConfigError, "'time_step_rank'"),
    (dict(SSM, ssm_cfg=dict(layer="Mamba3")), UnsupportedModel, "ssm_cfg.layer = 'Mamba3'"),
    (dict(SSM, ssm_cfg={}, attn_layer_idx=[1]), UnsupportedModel, "attn_layer_idx"),
    (dict(SSM, ssm_cfg={}, d_intermediate=128), UnsupportedModel, "d_intermediate = 128"),
    (dict(SSM, ssm_cfg={}, rms_norm=False), UnsupportedModel, "rms_norm = False"),
    (dict(SSM, ssm_cfg=dict(layer="Mamba2", headdim=16, norm_before_gate=True)), UnsupportedModel,
     "ssm_cfg.norm_before_gate = True"),
    (dict(SSM, ssm_cfg=dict(layer="Mamba2", headdim=16, d_ssm=32)), UnsupportedModel, "ssm_cfg.d_ssm = 32"),
    (dict(SSM, ssm_cfg=dict(layer="Mamba2", headdim=16, D_has_hdim=True)), UnsupportedModel, "ssm_cfg.D_has_hdim"),
    (dict(SSM, ssm_cfg=dict(layer="Mamba2", headdim=24)), ConfigError, "'ssm_cfg.headdim' = 24"),
])
def test_refusals_name_the_field(config, error, words):
    with pytest.raises(error, match=words):
        plan_for(config)


def test_init_only_and_stale_fields_are_accepted():
    plan = plan_for(dict(MAMBA2, time_step_min=0.01, time_step_max=0.2, time_step_floor=1e-3, norm_before_gate=True,
                         time_step_limit=[0.0, {"__float__": "Infinity"}], rescale_prenorm_residual=True))
    assert plan.block_options["dt_limit"] == (0.0, float("inf"))
    assert plan.max_position_embeddings is None and plan.head_name == "lm_head.weight"


def test_block_kwargs_carry_mamba2_dt_limit_only(checkpoint):
    """The page: "block_kwargs (Mamba-2's dt_limit, else empty)"."""
    path, reference = checkpoint("mamba2_dt_limit")
    assert CausalLM.load(path, device="cpu").plan.block_kwargs == {
        "dt_limit": tuple(reference.config.time_step_limit)}
    assert CausalLM.load(checkpoint("mamba")[0], device="cpu").plan.block_kwargs == {}


def test_built_from_weights_equals_loaded(checkpoint):
    path, reference = checkpoint("mamba2_groups_tied")
    lm = CausalLM(plan_for(HFConfig.from_json(path)), reference.state_dict(), device="cpu")
    ids = ids_for((2, 7), 5)
    assert torch.equal(lm.forward(ids), CausalLM.load(path, device="cpu").forward(ids))
