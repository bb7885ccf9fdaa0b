"""Phi-3, Phi-3.5 and Phi-4-mini (`phi3`), as transformers' Phi3ForCausalLM: Llama's stack with

- the checkpoint's fused `qkv_proj` and `gate_up_proj` tensors (read whole into the blocks' fused matrices);
- LongRoPE: per-frequency short and long factors, the long ones for a forward past the original context, and
  cos/sin scaled by the attention factor from the original context (rope type "su" and "yarn" in older Phi-3
  configs mean LongRoPE, as transformers reads them);
- `partial_rotary_factor` (Phi-4-mini rotates 3/4 of each head);
- one sliding window on every layer where `sliding_window` is set.
"""

from ..config import MAX_LAYERS, MAX_POSITIONS
from . import transformer
from .base import ROPE_TYPES, Family, Fields, GGUFArchitecture


def plan(f: Fields, family: Family):
    rotary = transformer.rope(f, *_rope_spec(f), types=family.rope_types)
    options = transformer.attention_options(f, family, rotary=rotary)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        if f.cfg.get(key) not in (None, 1, 1.0):
            raise f.refuse(key, f.cfg.get(key), f"{f.model_type} does not use it")
    n_layers = f.int("num_hidden_layers", maximum=MAX_LAYERS)
    window = f.optional_int("sliding_window", maximum=MAX_POSITIONS)
    return transformer.make_plan(f, family, options, n_layers, (window,) * n_layers, tensors=_layer_tensors)


def _rope_spec(f: Fields) -> tuple:
    """The rope spec and its source with Phi-3's legacy types "su" and "yarn" read as "longrope"."""
    params, legacy = f.cfg.get("rope_parameters"), f.cfg.get("rope_scaling")
    source = "rope_parameters" if params is not None else "rope_scaling"
    spec = params if params is not None else legacy
    if spec is None:
        return {}, source
    if not isinstance(spec, dict):
        raise f.bad(source, spec, "an object")
    kind = spec.get("rope_type", spec.get("type"))
    if kind in ("su", "yarn"):
        spec = {**{k: v for k, v in spec.items() if k != "type"}, "rope_type": "longrope"}
    return spec, source


def _layer_tensors(o: dict, prefix: str) -> tuple:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    return (("attn_norm.weight", prefix + "input_layernorm.weight", None),
            ("attn.qkv.weight", attn + "qkv_proj.weight", None),
            ("attn.o.weight", attn + "o_proj.weight", None),
            ("mlp_norm.weight", prefix + "post_attention_layernorm.weight", None),
            ("mlp.gate_up.weight", mlp + "gate_up_proj.weight", None),
            ("mlp.down.weight", mlp + "down_proj.weight", None))


FAMILIES = {
    "phi3": Family(kind="transformer", plan=plan, qkv_bias=False, o_bias=False, partial_rotary=True,
                   rope_types=(*ROPE_TYPES, "longrope")),
}


def gguf_config(file) -> dict:
    """llama.cpp's phi3 metadata as transformers' config: LongRoPE's factors are the tensors rope_factors_short
    and rope_factors_long, its original context and attention factor `phi3.rope.scaling.*` keys."""
    config = transformer.gguf_config(file, "phi3")
    config.pop("use_sliding_window", None)
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    if any(name in file for name in names):
        short, long = (file.read(name).tolist() if name in file else None for name in names)
        rope = dict(rope_type="longrope", rope_theta=config.pop("rope_theta"), short_factor=short, long_factor=long,
                    original_max_position_embeddings=file.get("{arch}.rope.scaling.original_context_length", None))
        if (attention := file.get("{arch}.rope.scaling.attn_factor", None)) is not None:
            rope["attention_factor"] = attention
        if "partial_rotary_factor" in config:
            rope["partial_rotary_factor"] = config.pop("partial_rotary_factor")
        config["rope_parameters"] = rope
    return config


GGUF_LAYER_NAMES = {**transformer.GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
GGUF = {"phi3": GGUFArchitecture(model_type="phi3", hf_class="Phi3ForCausalLM", config=gguf_config,
                                 names=transformer.GGUF_NAMES, layer_names=GGUF_LAYER_NAMES)}
