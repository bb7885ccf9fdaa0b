"""Tiny random checkpoints of every family, saved by transformers: the oracle runs in the same test."""

import json
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, initializer_range=0.1)

# name -> (transformers config class name, config overrides, save options)
VARIANTS = {
    "llama": ("LlamaConfig", {}, {}),
    "llama_tied_gqa": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True), {}),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh"), {}),
    "llama3_rope": ("LlamaConfig", dict(num_key_value_heads=1, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)), {}),
    "llama_linear_rope": ("LlamaConfig", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                   factor=2.0)), {}),
    "llama_yarn_rope": ("LlamaConfig", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                                 original_max_position_embeddings=32)), {}),
    "llama_legacy_rope": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)), dict(legacy_rope=True)),
    "llama_sharded": ("LlamaConfig", dict(num_key_value_heads=2), dict(max_shard_size="60KB")),
    "llama_bf16": ("LlamaConfig", dict(num_key_value_heads=2), dict(dtype=torch.bfloat16)),
    "mistral_window": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=5), {}),
    "qwen2_sliding": ("Qwen2Config", dict(num_key_value_heads=2, num_hidden_layers=3, use_sliding_window=True,
                                          sliding_window=6, max_window_layers=1, tie_word_embeddings=True), {}),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=24), {}),
    # rows of 256 and 512 values: the GGUF K-quants' blocks
    "llama_wide": ("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_key_value_heads=2,
                                       tie_word_embeddings=True, initializer_range=0.03), {}),
    "qwen3_bias_sliding": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=8, attention_bias=True,
                                               use_sliding_window=True, sliding_window=4,
                                               max_window_layers=1), {}),
    # Gemma 2: (1 + w) norms, sandwich norms, scaled embedding, query_pre_attn_scalar, both soft-caps, every other
    # layer sliding (transformers' default pattern)
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, num_hidden_layers=3, sliding_window=5,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=3.0), {}),
    # Gemma 3: q/k norms, sliding layers with their own rope theta, the global ones with linear scaling
    "gemma3_text": ("Gemma3TextConfig", dict(
        num_key_value_heads=1, head_dim=16, num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=6.0,
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=100000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=1000.0)}), {}),
    # the same ideas in the spelling of transformers 4 saves: rope_theta, rope_local_base_freq, rope_scaling, and
    # sliding_window_pattern in place of layer_types
    "gemma3_text_legacy": ("Gemma3TextConfig", dict(
        num_key_value_heads=2, head_dim=16, num_hidden_layers=4, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=50000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=500.0)}),
                           dict(legacy_gemma3=True)),
    # mixtures of experts: top 2 of 4 without renormalizing, layer 2 dense by mlp_only_layers; top 3 of 6
    # renormalized in every other layer, every layer sliding (transformers' Qwen3-MoE reads no max_window_layers);
    # Mixtral's top 2 of 4 with a sliding window
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, num_hidden_layers=4, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                                         mlp_only_layers=[2]), {}),
    "qwen3_moe_norm": ("Qwen3MoeConfig", dict(num_key_value_heads=1, head_dim=8, num_hidden_layers=3, num_experts=6,
                                              num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True,
                                              decoder_sparse_step=2, use_sliding_window=True, sliding_window=5,
                                              max_window_layers=2), {}),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=6), {}),
    # Phi-3: fused qkv_proj / gate_up_proj, LongRoPE (short factors and the attention factor from 128 / 64; the
    # long ones past position 64, tests/test_phi3.py), a window on every layer
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, sliding_window=5, original_max_position_embeddings=64,
                                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                     short_factor=[1.0 + 0.1 * i for i in range(8)],
                                                     long_factor=[2.0 + 0.5 * i for i in range(8)])), {}),
    # Phi-4-mini: 3/4 of each head rotated, tied head
    "phi4_mini": ("Phi3Config", dict(num_key_value_heads=1, partial_rotary_factor=0.75, tie_word_embeddings=True,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                     original_max_position_embeddings=64,
                                     rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                          partial_rotary_factor=0.75,
                                                          short_factor=[1.0 + 0.2 * i for i in range(6)],
                                                          long_factor=[3.0 + i for i in range(6)])), {}),
}


def _perturb(model):
    """Random init leaves norms at 1 and biases at 0; move them so a misapplied one shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _to_legacy_rope(config_path: Path):
    """Rewrite transformers 5's rope_parameters in the rope_theta + rope_scaling spelling of older saves."""
    cfg = json.loads(config_path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    config_path.write_text(json.dumps(cfg, indent=2))


def _to_legacy_gemma3(config_path: Path):
    """Rewrite a Gemma 3 config.json as transformers 4 saved it."""
    cfg = json.loads(config_path.read_text())
    params = cfg.pop("rope_parameters")
    full = params["full_attention"]
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full
    cfg["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
    types = cfg.pop("layer_types")
    cfg["sliding_window_pattern"] = types.index("full_attention") + 1
    assert types == ["full_attention" if (i + 1) % cfg["sliding_window_pattern"] == 0 else "sliding_attention"
                     for i in range(len(types))]
    config_path.write_text(json.dumps(cfg, indent=2))


def build_checkpoint(name: str, root: Path):
    """Save variant `name` under root/name; return (path, transformers model in float32)."""
    import transformers

    config_cls, overrides, save = VARIANTS[name]
    torch.manual_seed(sum(map(ord, name)))
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _perturb(model)
    path = root / name
    saved = model.to(save["dtype"]) if "dtype" in save else model
    saved.save_pretrained(path, **({"max_shard_size": save["max_shard_size"]} if "max_shard_size" in save else {}))
    if save.get("legacy_rope"):
        _to_legacy_rope(path / "config.json")
    if save.get("legacy_gemma3"):
        _to_legacy_gemma3(path / "config.json")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, reference


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(name) -> (path, transformers reference model); built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build_checkpoint(name, root)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
    """The default model (SmolLM2-135M-Instruct GGUF) written as a Hugging Face directory by lmstack convert."""
    from lmstack.convert import convert
    from lmstack.models import smollm2

    out = tmp_path_factory.mktemp("smollm2-hf")
    convert(smollm2(), out)
    return out
