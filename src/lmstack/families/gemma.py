"""Gemma 2 and Gemma 3 (text): Llama's stack with Gemma's own ideas, as transformers' Gemma2/Gemma3ForCausalLM.

- RMSNorm scaling by (1 + weight), computed in float32 (`norm_offset` 1.0), also on Gemma 3's q/k norms;
- sandwich norms: a norm after attention and after the MLP, before each residual add;
- the embedding multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- attention scores scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- soft-capping, cap * tanh(x / cap), of attention scores (Gemma 2) and of the final logits;
- sliding-window and global layers interleaved (layer_types, else sliding_window_pattern: 2 for Gemma 2, 6 for
  Gemma 3), Gemma 3's sliding layers with their own rotary settings (rope_local_base_freq);
- a GELU-tanh MLP and a tied head.

The multimodal `gemma3` (Gemma3ForConditionalGeneration) is refused by name: its text tower is `gemma3_text`.
"""

from ..config import MAX_LAYERS, MAX_POSITIONS
from . import transformer
from .base import Family, Fields, GGUFArchitecture

PATTERNS = {"gemma2": 2, "gemma3_text": 6}  # transformers' default sliding_window_pattern: layer i slides unless
# (i + 1) % pattern == 0
GLOBAL_THETA = {"gemma2": 10000.0, "gemma3_text": 1_000_000.0}
LOCAL_THETA = 10000.0
NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
         "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def plan(f: Fields, family: Family):
    gemma3 = f.model_type == "gemma3_text"
    if f.bool("use_bidirectional_attention", False):
        raise f.refuse("use_bidirectional_attention", True, "causal attention only")
    if gemma3 and f.cfg.get("attn_logit_softcapping") is not None:
        raise f.refuse("attn_logit_softcapping", f.cfg["attn_logit_softcapping"],
                       "transformers' Gemma 3 does not apply it; refused rather than guessed")
    global_rope, local_rope = _ropes(f, gemma3)
    options = transformer.attention_options(f, family, act=(_act_key(f), "gelu_pytorch_tanh"), rotary=global_rope)
    n_layers = f.int("num_hidden_layers", maximum=MAX_LAYERS)
    options.update(
        norm_offset=1.0, sandwich_norms=True,
        attn_scale=f.number("query_pre_attn_scalar", 256.0) ** -0.5,  # transformers' default
        attn_softcap=None if gemma3 else f.number("attn_logit_softcapping"),
    )
    if local_rope is not None:
        options["local_rope"] = local_rope
    windows = _windows(f, n_layers)
    return transformer.make_plan(
        f, family, options, n_layers, windows, norms=NORMS,
        embed_scale=float(f.int("hidden_size")) ** 0.5,
        final_softcap=f.number("final_logit_softcapping"))


def _act_key(f: Fields) -> str:
    """transformers' Gemma reads hidden_activation; older configs also carry a hidden_act, which it ignores."""
    return "hidden_activation" if f.cfg.get("hidden_activation") is not None or f.cfg.get("hidden_act") is None \
        else "hidden_act"


def _ropes(f: Fields, gemma3: bool) -> tuple[dict, dict | None]:
    """The global layers' rotary settings, and Gemma 3's sliding layers' (None: the same for every layer)."""
    params = f.cfg.get("rope_parameters")
    if not gemma3:
        if f.cfg.get("rope_local_base_freq") is not None:
            raise f.refuse("rope_local_base_freq", f.cfg["rope_local_base_freq"], "Gemma 2 has one rotary setting")
        return transformer.rope(f), None
    if isinstance(params, dict) and _per_type(params):
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise f.refuse("rope_parameters", unknown, "layer types full_attention and sliding_attention only")
        full = _with_theta(f, params.get("full_attention"), "rope_parameters.full_attention",
                           GLOBAL_THETA["gemma3_text"])
        local = _with_theta(f, params.get("sliding_attention"), "rope_parameters.sliding_attention", LOCAL_THETA)
        return (transformer.rope(f, full, "rope_parameters.full_attention"),
                transformer.rope(f, local, "rope_parameters.sliding_attention"))
    spec = params if params is not None else f.cfg.get("rope_scaling")
    source = "rope_parameters" if params is not None else "rope_scaling"
    spec = _with_theta(f, spec, source, f.cfg.get("rope_theta", GLOBAL_THETA["gemma3_text"]))
    local = {"rope_type": "default", "rope_theta": f.cfg.get("rope_local_base_freq", LOCAL_THETA)}
    return transformer.rope(f, spec, source), transformer.rope(f, local, "rope_local_base_freq")


def _per_type(params: dict) -> bool:
    return any(isinstance(v, dict) for v in params.values())


def _with_theta(f: Fields, spec, source: str, theta) -> dict:
    """A rope spec (None: the default one) with rope_theta filled in where it leaves it out."""
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise f.bad(source, spec, "an object")
    return {"rope_theta": theta, **spec}


def _windows(f: Fields, n_layers: int) -> tuple:
    window = f.optional_int("sliding_window", maximum=MAX_POSITIONS)
    if f.cfg.get("layer_types") is not None:
        return transformer.windows_of_types(f, n_layers, window)
    pattern = f.int("sliding_window_pattern", PATTERNS[f.model_type], maximum=MAX_LAYERS)
    sliding = [bool((i + 1) % pattern) for i in range(n_layers)]
    if window is None and any(sliding):
        raise f.bad("sliding_window", None, f"a window for the sliding layers of sliding_window_pattern {pattern}")
    return tuple(window if s else None for s in sliding)


FAMILIES = {
    "gemma2": Family(kind="transformer", plan=plan, tie=True),
    "gemma3_text": Family(kind="transformer", plan=plan, qk_norm=True, tie=True),
}
REFUSED = {"gemma3": "Gemma 3 with its vision tower; lmstack runs its text model, model_type 'gemma3_text' "
                     "(Gemma3ForCausalLM checkpoints such as gemma-3-270m and gemma-3-1b)"}

GGUF_LAYER_NAMES = {**transformer.GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def gguf_config(file, model_type: str) -> dict:
    """llama.cpp's Gemma metadata as transformers' config: what llama.cpp fixes in code made explicit."""
    config = transformer.gguf_config(file, model_type)
    config.pop("use_sliding_window", None)
    config["hidden_activation"] = "gelu_pytorch_tanh"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (value := file.get(f"{{arch}}.{key}", None)) is not None:
            config[key] = value
    # llama.cpp scales queries by 1/sqrt(head_dim), and by 1/sqrt(hidden_size / heads) for the 27B models
    # (46 layers for Gemma 2, 62 for Gemma 3), as their query_pre_attn_scalar says
    big = config["num_hidden_layers"] == (62 if model_type == "gemma3_text" else 46)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
    pattern = file.get("{arch}.attention.sliding_window_pattern", None)
    if isinstance(pattern, list):
        config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    elif pattern is not None:
        config["sliding_window_pattern"] = pattern
    if model_type == "gemma3_text":
        config["rope_local_base_freq"] = file.get("{arch}.rope.freq_base_swa", LOCAL_THETA)
    return config


def _gguf(model_type: str, hf_class: str) -> GGUFArchitecture:
    return GGUFArchitecture(
        model_type=model_type, hf_class=hf_class, config=lambda file: gguf_config(file, model_type),
        names=transformer.GGUF_NAMES, layer_names=GGUF_LAYER_NAMES,
        norm_offset=1.0)  # llama.cpp's converter stores each norm weight as 1 + weight


GGUF = {"gemma2": _gguf("gemma2", "Gemma2ForCausalLM"), "gemma3": _gguf("gemma3_text", "Gemma3ForCausalLM")}
