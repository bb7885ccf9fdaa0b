"""Llama and Mistral: the plain pre-norm transformer; Mistral fixes its biases off and slides one window everywhere."""

from . import moe, transformer
from .base import Family, GGUFArchitecture

FAMILIES = {
    "llama": Family(kind="transformer", plan=transformer.plan, mlp_bias_field=True),
    "mistral": Family(kind="transformer", plan=transformer.plan, qkv_bias=False, o_bias=False, window="all"),
}


def _gguf(model_type: str, hf_class: str) -> GGUFArchitecture:
    return GGUFArchitecture(
        model_type=model_type, hf_class=hf_class,
        config=lambda file: transformer.gguf_config(file, model_type),
        names=transformer.GGUF_NAMES, layer_names=transformer.GGUF_LAYER_NAMES,
        permuted_qk=True)  # llama.cpp's converter interleaves each head's rotary halves for Llama's layout


def _llama_config(file) -> dict:
    """llama.cpp writes Mixtral as architecture llama with an expert_count: its config is Mixtral's."""
    if file.get("{arch}.expert_count", 0):
        return moe.gguf_config(file, "mixtral")
    return transformer.gguf_config(file, "llama")


GGUF = {"llama": GGUFArchitecture(
            model_type="llama", hf_class="LlamaForCausalLM", config=_llama_config, names=transformer.GGUF_NAMES,
            layer_names={**transformer.GGUF_LAYER_NAMES, **moe.GGUF_ROUTER_NAMES["mixtral"]},
            expert_names=moe.GGUF_EXPERT_NAMES["mixtral"], permuted_qk=True),
        "mistral": _gguf("mistral", "MistralForCausalLM")}
