"""Gemma 2 and Gemma 3 beyond the parity tests (test_parity.py runs the gemma VARIANTS): the plan's refusals by
name, the fused kernel step taking Gemma 3's options and refusing Gemma 2's soft-capping, GGUF files written as
llama.cpp's converter writes them, and `lmstack info`."""

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers

from conftest import BASE, _perturb
from test_gguf import finish, gguf_writer
from lmstack import CausalLM, UnsupportedModel, plan_for
from lmstack.gguf import GGUFFile

GEMMA3 = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=96, num_hidden_layers=7,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=256, sliding_window=8)


def test_gemma3_plan_follows_transformers_defaults():
    plan = plan_for(GEMMA3)
    assert plan.layer_windows == (8, 8, 8, 8, 8, None, 8)  # sliding_window_pattern 6: every sixth layer global
    o = plan.block_options
    assert o["rope"] == {"type": "default", "theta": 1_000_000.0} and o["local_rope"]["theta"] == 10000.0
    assert o["attn_scale"] == 256 ** -0.5 and o["act"] == "gelu_pytorch_tanh" and o["qk_norm"]
    assert plan.tie_embeddings and plan.embed_scale == 8.0 and plan.final_softcap is None
    names = [name for _, name, _ in plan.layer_weights(0)]
    assert {f"model.layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm",
                                                  "pre_feedforward_layernorm", "post_feedforward_layernorm",
                                                  "self_attn.q_norm", "self_attn.k_norm")} <= set(names)
    gemma2 = plan_for({**GEMMA3, "model_type": "gemma2", "num_hidden_layers": 4})
    assert gemma2.layer_windows == (8, None, 8, None) and "local_rope" not in gemma2.block_options


@pytest.mark.parametrize("changes, words", [
    (dict(model_type="gemma3"), "vision tower"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}, "chunked": {}}), "chunked"),
    (dict(hidden_activation="swish"), "hidden_activation"),
    (dict(model_type="gemma2", rope_local_base_freq=10.0), "rope_local_base_freq"),
])
def test_refusals_name_the_field(changes, words):
    with pytest.raises(UnsupportedModel, match=words):
        plan_for({**GEMMA3, **changes})


def test_fused_step_takes_gemma3s_options_and_refuses_soft_capping(tiny_checkpoint):
    """kernels_layer.cpp's Layer takes Gemma 3's options (test_fused_layer.py checks its numbers); Gemma 2's
    soft-capped attention it does not take: those blocks say so and run their Python path."""
    gemma3 = CausalLM.load(tiny_checkpoint("gemma3_text")[0], device="cpu")
    assert all(block.fused_options() == [] and block.fused_layer(torch.float32) is not None
               for block in gemma3.blocks)
    gemma2 = CausalLM.load(tiny_checkpoint("gemma2")[0], device="cpu")
    for block in gemma2.blocks:
        assert block.fused_options() == ["attn_softcap"] and block.fused_layer(torch.float32) is None


def gemma_checkpoint(tmp_path, config_cls, **overrides):
    """A tiny random Gemma saved by transformers; its queries scaled by 1/sqrt(head_dim) as llama.cpp scales them
    (GGUF has no key for query_pre_attn_scalar)."""
    torch.manual_seed(7)
    config = getattr(transformers, config_cls)(**{**BASE, "head_dim": 16, "query_pre_attn_scalar": 16, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _perturb(model)
    model.save_pretrained(tmp_path / "hf")
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()


GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gemma_gguf(path, reference, arch, extra):
    """As llama.cpp's convert_hf_to_gguf.py writes Gemma: norms stored as 1 + weight, q/k rows as they are, no
    output tensor (tied); `extra` writes the metadata keys beyond the shared ones."""
    c = reference.config
    writer = gguf_writer(path, c, arch)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_sliding_window(c.sliding_window)
    extra(writer)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<{i}>" for i in range(c.vocab_size)])
    writer.add_token_scores([0.0] * c.vocab_size)
    writer.add_token_types([1] * c.vocab_size)
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight":
            continue
        w = tensor.float().numpy()
        if name.endswith("norm.weight"):
            w = w + 1
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, i, stem = name.removesuffix(".weight").split(".", 3)
            gguf_name = f"blk.{i}.{GGUF_LAYER[stem]}.weight"
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    finish(writer)


def gemma2_keys(c):
    def extra(writer):
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    return extra


def gemma3_keys(c):
    def extra(writer):
        full, local = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_freq_base_swa(local["rope_theta"])  # llama.cpp's own default is 10000
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    return extra


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gguf_logits_match_transformers(tmp_path, arch):
    """A norm read without its +1 undone, a missed sandwich norm, soft-cap, pattern or local rope changes these."""
    if arch == "gemma2":
        reference = gemma_checkpoint(tmp_path, "Gemma2Config", num_key_value_heads=2, num_hidden_layers=3,
                                     sliding_window=5, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
        extra = gemma2_keys(reference.config)
    else:
        reference = gemma_checkpoint(
            tmp_path, "Gemma3TextConfig", num_key_value_heads=1, num_hidden_layers=3, sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=100000.0),
                             "sliding_attention": dict(rope_type="default", rope_theta=1000.0)})
        extra = gemma3_keys(reference.config)
    write_gemma_gguf(tmp_path / "m.gguf", reference, arch, extra)
    with GGUFFile(tmp_path / "m.gguf") as source:
        hf = dict(reference.state_dict())
        for name in source.names():  # the norms' + 1 undone on read
            torch.testing.assert_close(source.read(name), hf[name].float(), rtol=0, atol=1e-6, msg=name)
    lm = CausalLM.load(tmp_path / "m.gguf", device="cpu")
    assert lm.plan.family == ("gemma2" if arch == "gemma2" else "gemma3_text")
    assert lm.plan.layer_windows == tuple(5 if t == "sliding_attention" else None for t in reference.config.layer_types)
    ids = torch.randint(0, lm.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(lm.forward(ids), expected, rtol=1e-4, atol=1e-4)


def test_info_shows_gemma_options(tiny_checkpoint):
    path, _ = tiny_checkpoint("gemma2")
    out = subprocess.run([sys.executable, "-m", "lmstack", "info", str(path)], capture_output=True, text=True,
                         check=True).stdout
    text = " ".join(out.split())
    for words in ("gemma2 (transformer)", "sliding window [5] on 2 of 3 layers", "norm scale 1 + weight",
                  "sandwich norms", "attention scale 0.2041", "attention softcap 5", "embedding scale 8",
                  "final logit softcap 3"):
        assert words in text, (words, out)
