"""Mamba 1 and Mamba 2: recurrent (selective state space) stacks, from transformers' config or mamba_ssm's own."""

import math

from ..config import MAX_LAYERS, MAX_VOCAB, HFConfig, ModelPlan
from .base import Family, Fields


def plan(f: Fields, family: Family) -> ModelPlan:
    """Mamba 1 and Mamba 2 stacks, as transformers' MambaForCausalLM / Mamba2ForCausalLM compute them.

    time_step_min/max/floor/scale/init_scheme, rescale_prenorm_residual and initializer_range only shape a
    random init, and use_mambapy / use_associative_scan only pick transformers' scan code: all are ignored.
    """
    embed_name = "backbone.embeddings.weight"
    if f.cfg.mamba_ssm_format:
        f, embed_name = Fields(_from_mamba_ssm(f)), "backbone.embedding.weight"
    mamba2 = family.kind == "mamba2"
    d_model = f.int("hidden_size")
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise f.refuse("hidden_act", act, "the conv activation is SiLU, the only one the reference kernels run")
    options = dict(
        d_inner=f.int("expand", 2, maximum=64) * d_model,
        d_state=f.int("state_size", 128 if mamba2 else 16, maximum=4096),
        d_conv=f.int("conv_kernel", 4, maximum=64),
        bias=f.bool("use_bias", False),
        conv_bias=f.bool("use_conv_bias", True),
        residual_in_fp32=f.bool("residual_in_fp32", True),
        norm_eps=f.eps("layer_norm_epsilon", 1e-5),
    )
    if mamba2:
        options.update(_mamba2_options(f, options["d_inner"]))
    elif f.cfg.get("time_step_rank", "auto") == "auto":
        options["dt_rank"] = math.ceil(d_model / 16)
    else:
        options["dt_rank"] = f.int("time_step_rank")
    tie = f.bool("tie_word_embeddings", family.tie)
    n_layers = f.int("num_hidden_layers", maximum=MAX_LAYERS)
    return ModelPlan(
        model_type=f.model_type, family=f.model_type, kind=family.kind,
        n_layers=n_layers, d_model=d_model,
        vocab_size=f.int("vocab_size", maximum=MAX_VOCAB),
        tie_embeddings=tie, norm_eps=options["norm_eps"],
        max_position_embeddings=None, block_options=options,
        embed_name=embed_name, norm_name="backbone.norm_f.weight",
        head_name=None if tie else "lm_head.weight",
        layer_tensors=tuple(_layer_tensors(family.kind, options, f"backbone.layers.{i}.") for i in range(n_layers)),
    )


def _mamba2_options(f: Fields, d_inner: int) -> dict:
    """Heads, groups, chunking and the dt clamp of a Mamba 2 mixer.

    norm_before_gate is ignored, as transformers ignores it: its Mamba2 always multiplies the gate in before
    the gated RMSNorm, which is mamba_ssm's default and how released checkpoints were trained (their HF
    configs often carry a stale `norm_before_gate: true`). mamba_ssm-format configs that set it are refused.
    """
    n_heads = f.int("num_heads", 128)
    head_dim = f.int("head_dim", 64)
    if n_heads * head_dim != d_inner:
        raise f.bad("num_heads", n_heads, f"num_heads * head_dim ({head_dim}) == expand * hidden_size ({d_inner})")
    n_groups = f.int("n_groups", 8)
    if n_heads % n_groups:
        raise f.bad("n_groups", n_groups, f"a divisor of num_heads ({n_heads})")
    if not f.bool("rms_norm", True):
        raise f.refuse("rms_norm", False, "the gated RMSNorm before out_proj is always applied, as in transformers")
    limit = f.cfg.get("time_step_limit", (0.0, math.inf))
    if isinstance(limit, (list, tuple)):
        limit = [_json_float(v) for v in limit]
    if (not isinstance(limit, (list, tuple)) or len(limit) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) for v in limit)
            or not 0 <= limit[0] <= limit[1]):
        raise f.bad("time_step_limit", limit, "[low, high] with 0 <= low <= high")
    return dict(n_heads=n_heads, head_dim=head_dim, n_groups=n_groups,
                chunk_size=f.int("chunk_size", 256, maximum=1 << 16), dt_limit=(float(limit[0]), float(limit[1])))


def _json_float(value):
    """transformers 5 writes inf and nan as {"__float__": "Infinity"}; older saves as bare Infinity."""
    special = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
    if isinstance(value, dict) and value.keys() == {"__float__"} and str(value["__float__"]) in special:
        return special[value["__float__"]]
    return value


def _from_mamba_ssm(f: Fields) -> HFConfig:
    """An original mamba_ssm config (d_model, n_layer, ssm_cfg, ...) in transformers' field names.

    mamba_ssm pads the vocabulary to a multiple of pad_vocab_size_multiple and fixes both norm epsilons at
    1e-5; fused_add_norm only fuses kernels. What has no transformers equivalent is refused here by name.
    """
    cfg = f.cfg
    ssm = cfg.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        raise f.bad("ssm_cfg", ssm, "an object")
    s = Fields(HFConfig({**ssm, "model_type": f.model_type}, cfg.path), prefix="ssm_cfg.")
    layer = s.str("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise s.refuse("layer", layer, "supported: Mamba1, Mamba2")
    if cfg.get("attn_layer_idx"):
        raise f.refuse("attn_layer_idx", cfg["attn_layer_idx"], "attention layers between the Mamba layers")
    if cfg.get("d_intermediate"):
        raise f.refuse("d_intermediate", cfg["d_intermediate"], "an MLP after each mixer")
    if not f.bool("rms_norm", True):
        raise f.refuse("rms_norm", False, "LayerNorm blocks; RMSNorm only")
    d_model, expand = f.int("d_model"), s.int("expand", 2, maximum=64)
    vocab, multiple = f.int("vocab_size", maximum=MAX_VOCAB), f.int("pad_vocab_size_multiple", 8)
    mamba2 = layer == "Mamba2"
    out = dict(
        model_type=f.model_type, hidden_size=d_model, num_hidden_layers=f.int("n_layer", maximum=MAX_LAYERS),
        vocab_size=vocab + -vocab % multiple, expand=expand,
        state_size=s.int("d_state", 128 if mamba2 else 16, maximum=4096), conv_kernel=s.int("d_conv", 4, maximum=64),
        use_bias=s.bool("bias", False), use_conv_bias=s.bool("conv_bias", True),
        residual_in_fp32=f.bool("residual_in_fp32", True), tie_word_embeddings=f.bool("tie_embeddings", True),
        layer_norm_epsilon=1e-5,
    )
    if not mamba2:
        out["time_step_rank"] = ssm.get("dt_rank", "auto")
        return HFConfig(out, cfg.path)
    d_inner, head_dim = expand * d_model, s.int("headdim", 64)
    if ssm.get("d_ssm") not in (None, d_inner):
        raise s.refuse("d_ssm", ssm["d_ssm"], f"an SSM over part of the inner width ({d_inner})")
    if d_inner % head_dim:
        raise s.bad("headdim", head_dim, f"a divisor of expand * d_model ({d_inner})")
    for key, default, why in (("rmsnorm", True, "the gated RMSNorm is always applied"),
                              ("norm_before_gate", False, "the gate is applied before the norm"),
                              ("D_has_hdim", False, "D holds one value per head")):
        if s.bool(key, default) != default:
            raise s.refuse(key, not default, why)
    out.update(num_heads=d_inner // head_dim, head_dim=head_dim, n_groups=s.int("ngroups", 1),
               chunk_size=s.int("chunk_size", 256, maximum=1 << 16),
               time_step_limit=ssm.get("dt_limit", (0.0, math.inf)))
    return HFConfig(out, cfg.path)


def _layer_tensors(kind: str, o: dict, prefix: str) -> tuple:
    """Block parameters carry the checkpoint's own names below the layer prefix."""
    names = ["norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight"]
    if kind == "mamba1":
        names += ["mixer.x_proj.weight", "mixer.dt_proj.weight", "mixer.dt_proj.bias"]
    else:
        names += ["mixer.dt_bias", "mixer.norm.weight"]
    names += ["mixer.A_log", "mixer.D", "mixer.out_proj.weight"]
    if o["bias"]:
        names += ["mixer.in_proj.bias", "mixer.out_proj.bias"]
    if o["conv_bias"]:
        names.append("mixer.conv1d.bias")
    keys = {"mixer.dt_proj.bias": "mixer.dt_bias"}  # Mamba 1's, kept float32 apart from its (re-storable) matrix
    return tuple((keys.get(name, name), prefix + name, None) for name in names)


FAMILIES = {
    "mamba": Family(kind="mamba1", plan=plan, tie=True),
    "mamba2": Family(kind="mamba2", plan=plan),
}
