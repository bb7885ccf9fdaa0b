"""The decoder-only transformer every attention family starts from (Llama's): its config fields, rotary settings,
sliding windows, Hugging Face tensor names, and llama.cpp's GGUF metadata and tensor names.

A family close to Llama is a `Family` row planned by `plan`; one with ideas of its own calls the pieces here
(`attention_options`, `rope`, `layer_windows`, `layer_tensors`, `gguf_config`) and adds its options.
"""

import math

from ..config import MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ModelPlan, UnsupportedModel
from .base import ROPE_TYPES, Family, Fields

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
MIN_ROPE_THETA = 1.0  # below it the rotary frequencies exceed one turn per token (and 1e-320 makes them inf)

# block norm -> the Hugging Face name of its weight within a layer
NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}

# llama.cpp's tensor names (gguf-py's TENSOR_NAMES) -> Hugging Face's, for the Llama layout
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def plan(f: Fields, family: Family) -> ModelPlan:
    """A Llama-like stack: the family's row decides biases, q/k norms, windows and the tied default."""
    options = attention_options(f, family)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "logits_scaling", "embedding_multiplier",
                "query_pre_attn_scalar"):
        if f.cfg.get(key) not in (None, 1, 1.0):
            raise f.refuse(key, f.cfg.get(key), f"{f.model_type} does not use it")
    n_layers = f.int("num_hidden_layers", maximum=MAX_LAYERS)
    return make_plan(f, family, options, n_layers, layer_windows(f, family, n_layers))


def attention_options(f: Fields, family: Family, act: tuple = ("hidden_act", "silu"),
                      rotary: dict | None = None) -> dict:
    """The block options every attention family shares: heads, widths, biases, activation, rotary, norm eps."""
    d_model = f.int("hidden_size")
    n_heads = f.int("num_attention_heads", maximum=4096)
    n_kv_heads = f.int("num_key_value_heads", n_heads, maximum=4096)
    if n_heads % n_kv_heads:
        raise f.bad("num_key_value_heads", n_kv_heads, f"a divisor of num_attention_heads ({n_heads})")
    if f.cfg.get("head_dim") is None:
        if d_model % n_heads:
            raise f.bad("hidden_size", d_model,
                        f"a multiple of num_attention_heads ({n_heads}) when head_dim is absent")
        head_dim = d_model // n_heads
    else:
        head_dim = f.int("head_dim", maximum=4096)
    if head_dim % 2:
        raise f.bad("head_dim", head_dim, "an even number (rotary pairs)")

    act_key, act = act[0], f.str(*act)  # (config field, default)
    if act not in ACTIVATIONS:
        raise f.refuse(act_key, act, f"supported: {', '.join(ACTIVATIONS)}")
    attention_bias = f.bool("attention_bias", False)
    qkv_bias = attention_bias if family.qkv_bias is None else family.qkv_bias
    o_bias = attention_bias if family.o_bias is None else family.o_bias
    if family.qkv_bias is not None and f.cfg.get("attention_bias") not in (None, False, family.qkv_bias):
        raise f.refuse("attention_bias", f.cfg.get("attention_bias"), f"{f.model_type} fixes its own biases")
    mlp_bias = f.bool("mlp_bias", False)
    if mlp_bias and not family.mlp_bias_field:
        raise f.refuse("mlp_bias", mlp_bias, f"{f.model_type} has no MLP biases")

    partial = f.cfg.get("partial_rotary_factor")
    rotary = dict(rope(f, types=family.rope_types) if rotary is None else rotary)
    partial = rotary.pop("partial_rotary_factor", partial)
    options = dict(
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        d_ff=f.int("intermediate_size", maximum=MAX_WIDTH * 8),
        act=act, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
        qk_norm=family.qk_norm, rope=rotary, norm_eps=f.eps("rms_norm_eps", 1e-6),
    )
    rotary_dim = head_dim
    if partial not in (None, 1, 1.0):
        if not family.partial_rotary:
            raise f.refuse("partial_rotary_factor", partial, "rotary embedding over the whole head only")
        if (isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial < 1
                or int(head_dim * partial) % 2 or int(head_dim * partial) == 0):
            raise f.bad("partial_rotary_factor", partial, f"a number in (0, 1) giving an even, nonzero part of "
                                                          f"head_dim {head_dim}")
        options["rotary_dim"] = rotary_dim = int(head_dim * partial)
    if rotary["type"] == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(rotary[key]) != rotary_dim // 2:
                raise f.bad(f"rope_parameters.{key}", rotary[key], f"{rotary_dim // 2} numbers (half the rotated "
                                                                    f"part of a head)")
    return options


def make_plan(f: Fields, family: Family, options: dict, n_layers: int, windows: tuple,
              norms: dict = NORMS, tensors=None, **model_options) -> ModelPlan:
    """The plan of a stack of `n_layers` blocks with `options`, named as Hugging Face's Llama names them, or by
    `tensors(options, layer prefix)`."""
    tensors = tensors or (lambda o, prefix: layer_tensors(o, prefix, norms))
    tie = f.bool("tie_word_embeddings", family.tie)
    return ModelPlan(
        model_type=f.model_type, family=f.model_type, kind=family.kind,
        n_layers=n_layers, d_model=f.int("hidden_size"),
        vocab_size=f.int("vocab_size", maximum=MAX_VOCAB),
        tie_embeddings=tie, norm_eps=options["norm_eps"],
        max_position_embeddings=f.optional_int("max_position_embeddings"), block_options=options,
        embed_name="model.embed_tokens.weight", norm_name="model.norm.weight",
        head_name=None if tie else "lm_head.weight",
        layer_tensors=tuple(tensors(options, f"model.layers.{i}.") for i in range(n_layers)),
        layer_windows=windows, **model_options,
    )


def layer_tensors(o: dict, prefix: str, norms: dict = NORMS) -> tuple:
    """(block parameter, checkpoint tensor, rows it fills) of one layer: q/k/v and gate/up fill one fused
    parameter each, row range by row range."""
    q_rows, kv_rows = o["n_heads"] * o["head_dim"], o["n_kv_heads"] * o["head_dim"]
    ff = o["d_ff"]
    attn, mlp = prefix + "self_attn.", prefix + "mlp."

    def fused(key, parts, suffix):
        out, start = [], 0
        for name, rows in parts:
            out.append((f"{key}.{suffix}", f"{name}.{suffix}", slice(start, start + rows)))
            start += rows
        return out

    qkv = [(attn + "q_proj", q_rows), (attn + "k_proj", kv_rows), (attn + "v_proj", kv_rows)]
    gate_up = [(mlp + "gate_proj", ff), (mlp + "up_proj", ff)]
    w = [(f"{key}.weight", f"{prefix}{name}.weight", None) for key, name in norms.items()]
    w += fused("attn.qkv", qkv, "weight")
    if o["qkv_bias"]:
        w += fused("attn.qkv", qkv, "bias")
    w.append(("attn.o.weight", attn + "o_proj.weight", None))
    if o["o_bias"]:
        w.append(("attn.o.bias", attn + "o_proj.bias", None))
    if o["qk_norm"]:
        w += [("attn.q_norm.weight", attn + "q_norm.weight", None),
              ("attn.k_norm.weight", attn + "k_norm.weight", None)]
    w += fused("mlp.gate_up", gate_up, "weight")
    if o["mlp_bias"]:
        w += fused("mlp.gate_up", gate_up, "bias")
    w.append(("mlp.down.weight", mlp + "down_proj.weight", None))
    if o["mlp_bias"]:
        w.append(("mlp.down.bias", mlp + "down_proj.bias", None))
    return tuple(w)


def rope(f: Fields, spec=None, source=None, types=ROPE_TYPES) -> dict:
    """Normalize `rope_theta` + `rope_scaling` (legacy) and `rope_parameters` (transformers 5) to one dict;
    `spec` (named `source` in errors) stands for them where a family keeps one per layer type. `types`: the
    rope types the family's reference computes."""
    if spec is None:
        params = f.cfg.get("rope_parameters")
        legacy = f.cfg.get("rope_scaling")
        source = "rope_parameters" if params is not None else "rope_scaling"
        spec = params if params is not None else legacy
        if spec is None:
            spec = {}
        if not isinstance(spec, dict):
            raise f.bad(source, spec, "an object")
        if any(isinstance(v, dict) for v in spec.values()):
            raise f.refuse(source, sorted(spec), "rotary settings per layer type")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind not in types:
        raise f.refuse(f"{source}.rope_type", kind, f"supported: {', '.join(types)}")
    theta = spec.get("rope_theta", f.cfg.get("rope_theta", 10000.0))
    if (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta)
            or theta < MIN_ROPE_THETA):
        raise f.bad("rope_theta", theta, f"a finite number >= {MIN_ROPE_THETA}")
    out = {"type": kind, "theta": float(theta)}
    if "partial_rotary_factor" in spec:
        out["partial_rotary_factor"] = spec["partial_rotary_factor"]

    def number(key, default=None):
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise f.bad(f"{source}.{key}", value, "a positive number")
        return value

    if kind in ("linear", "llama3", "yarn"):
        out["factor"] = number("factor")
    if kind in ("llama3", "yarn"):
        original = spec.get("original_max_position_embeddings", f.cfg.get("max_position_embeddings"))
        out["original_max_position_embeddings"] = number("original_max_position_embeddings", original)
    if kind == "llama3":
        out["low_freq_factor"] = number("low_freq_factor")
        out["high_freq_factor"] = number("high_freq_factor")
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise f.bad(f"{source}.high_freq_factor", out["high_freq_factor"], "greater than low_freq_factor")
    if kind == "yarn":
        for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if spec.get(key) is not None:
                out[key] = number(key)
        out["truncate"] = spec.get("truncate", True)
    if kind == "longrope":
        original = spec.get("original_max_position_embeddings", f.cfg.get("original_max_position_embeddings"))
        out["original_max_position_embeddings"] = number("original_max_position_embeddings", original)
        if spec.get("factor") is None:  # the reference's default: the context's growth over the original
            context = f.int("max_position_embeddings", maximum=MAX_POSITIONS)
            out["factor"] = context / out["original_max_position_embeddings"]
        else:
            out["factor"] = number("factor")
        if spec.get("attention_factor") is not None:
            out["attention_factor"] = number("attention_factor")
        for key in ("short_factor", "long_factor"):
            factors = spec.get(key)
            if (not isinstance(factors, list) or not factors or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
                    for v in factors)):
                raise f.bad(f"{source}.{key}", factors, "a list of positive numbers")
            out[key] = [float(v) for v in factors]
    return out


def layer_windows(f: Fields, family: Family, n_layers: int) -> tuple:
    """The sliding-window length of each layer (None: full attention), as transformers builds it."""
    if family.window == "none":
        return (None,) * n_layers
    window = f.optional_int("sliding_window", maximum=MAX_POSITIONS)
    if family.window == "all":
        return (window,) * n_layers
    if not f.bool("use_sliding_window", False):
        window = None
    if f.cfg.get("layer_types") is None:
        first = f.int("max_window_layers", n_layers, minimum=0, maximum=MAX_LAYERS)
        return tuple(window if window is not None and i >= first else None for i in range(n_layers))
    return windows_of_types(f, n_layers, window)


def windows_of_types(f: Fields, n_layers: int, window: int | None) -> tuple:
    """Each layer's window from `layer_types`: `window` for sliding_attention, None for full_attention."""
    layer_types = f.cfg.get("layer_types")
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise f.bad("layer_types", layer_types, f"a list of {n_layers} layer types")
    out = []
    for kind in layer_types:
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            if window is None:
                raise f.bad("layer_types", kind, "full_attention when sliding_window is off")
            out.append(window)
        else:
            raise f.refuse("layer_types", kind, "supported: full_attention, sliding_attention")
    return tuple(out)


def gguf_config(file, model_type: str, experts: bool = False) -> dict:
    """The config.json a Hugging Face checkpoint of a GGUF file's model would carry, from llama.cpp's metadata
    keys (`{arch}.` prefixed) as every Llama-like architecture writes them; `experts`: the family reads the
    mixture's own keys (families/moe.py), else an expert_count is refused."""
    if "rope_freqs.weight" in file:
        raise UnsupportedModel(f"{file.path}: tensor 'rope_freqs.weight' (rotary frequencies stored as "
                               f"a tensor, as for Llama 3.1 scaling) is not supported")
    if not experts and file.get("{arch}.expert_count", 0):
        raise UnsupportedModel(f"{file.path}: {file.arch}.expert_count = {file.get('{arch}.expert_count')} "
                               f"(mixture of experts) is not supported")
    for key in ("head_count", "head_count_kv"):
        if isinstance(file.get(f"{{arch}}.attention.{key}", None), list):
            raise UnsupportedModel(f"{file.path}: {file.arch}.attention.{key} per layer is not supported")
    n_heads = file._int("{arch}.attention.head_count")
    n_kv_heads = file._int("{arch}.attention.head_count_kv", n_heads)
    embed = "model.embed_tokens.weight"
    vocab = file.get("{arch}.vocab_size", None) or (file.info(embed).shape[0] if embed in file else None)
    config = dict(
        model_type=model_type,
        hidden_size=file._int("{arch}.embedding_length"),
        num_hidden_layers=file.get("{arch}.block_count"),
        intermediate_size=file.get("{arch}.feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=file.get("{arch}.context_length", None),
        rms_norm_eps=file.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=file.get("{arch}.rope.freq_base", 10000.0),
        vocab_size=vocab,
        tie_word_embeddings="lm_head.weight" not in file,
        bos_token_id=file._int("tokenizer.ggml.bos_token_id", None, minimum=0),
        eos_token_id=eos[0] if len(eos := file.eos_ids()) == 1 else eos or None,
    )
    if (head_dim := file._int("{arch}.attention.key_length", None)) is not None:
        config["head_dim"] = head_dim
    head_dim = head_dim or config["hidden_size"] // n_heads
    rotary = file._int("{arch}.rope.dimension_count", head_dim)
    if head_dim and rotary != head_dim:
        config["partial_rotary_factor"] = rotary / head_dim
    scaling = file.get("{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": file.get("{arch}.rope.scaling.factor")}
    elif scaling == "yarn":
        config["rope_scaling"] = {
            "type": "yarn", "factor": file.get("{arch}.rope.scaling.factor"),
            "original_max_position_embeddings": file.get("{arch}.rope.scaling.original_context_length")}
    elif scaling != "none":
        config["rope_scaling"] = {"type": scaling}  # plan_for refuses it by name
    if (window := file.get("{arch}.attention.sliding_window", None)) is not None:
        config["sliding_window"] = window
        config["use_sliding_window"] = True
    return config
