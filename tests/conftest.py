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
