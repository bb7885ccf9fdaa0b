"""Qwen 2 (q/k/v biases) and Qwen 3 (q/k RMSNorms): Llama's stack with sliding windows from layer max_window_layers."""

from . import transformer
from .base import Family, GGUFArchitecture

FAMILIES = {
    "qwen2": Family(kind="transformer", plan=transformer.plan, qkv_bias=True, o_bias=False, window="per_layer"),
    "qwen3": Family(kind="transformer", plan=transformer.plan, qk_norm=True, window="per_layer"),
}


def _gguf(model_type: str, hf_class: str) -> GGUFArchitecture:
    return GGUFArchitecture(
        model_type=model_type, hf_class=hf_class,
        config=lambda file: transformer.gguf_config(file, model_type),
        names=transformer.GGUF_NAMES, layer_names=transformer.GGUF_LAYER_NAMES)


GGUF = {"qwen2": _gguf("qwen2", "Qwen2ForCausalLM"), "qwen3": _gguf("qwen3", "Qwen3ForCausalLM")}
