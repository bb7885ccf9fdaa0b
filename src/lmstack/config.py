"""config.json in, a ModelPlan out: the one place that knows model families.

Every config field that changes the arithmetic is either honored here or refused with
`UnsupportedModel` naming the field and its value, before any weight byte is read.
"""

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .rope import ROPE_TYPES

# Sizes beyond these are refused before anything is allocated: no released model comes close.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 17
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 24
MAX_JSON_BYTES = 128 << 20  # the largest released tokenizer.json is near 35 MB
EPS_RANGE = (1.1754943508222875e-38, 1.0)  # float32's smallest normal number, and 1
MIN_ROPE_THETA = 1.0  # below it the rotary frequencies exceed one turn per token (and 1e-320 makes them inf)


def shown(value, limit: int = 200) -> str:
    """repr(value) for an error message, cut short: a hostile file's 10 MB value is not a 10 MB line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class UnsupportedModel(ValueError):
    """The checkpoint is well formed, but asks for arithmetic lmstack does not implement."""


class ConfigError(ValueError):
    """config.json is missing, malformed, or holds a value of the wrong type or range."""


def read_json(path: Path, error=None) -> dict:
    """A JSON object from a file, or `error` (ConfigError by default) naming the path."""
    return parse_json(read_text(path, error), path, error)


def read_text(path: Path, error=None) -> str:
    """A UTF-8 file's text, refused before reading when larger than any JSON file we read should be."""
    error = error or ConfigError
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise error(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} we read from a JSON file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 ({e})") from None


def parse_json(text, where, error=None) -> dict:
    """A JSON object, refused by name when it is not one, nests past Python's recursion limit, holds
    an integer of more than 4300 digits, or gives a key twice (readers disagree on which one wins)."""
    error = error or ConfigError

    def unique(pairs):
        data = dict(pairs)
        if len(data) != len(pairs):
            key = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
            raise error(f"{where}: key {key!r} appears more than once in one object")
        return data

    try:
        data = json.loads(text, object_pairs_hook=unique)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError and int digits are ValueErrors
        if isinstance(e, error):
            raise
        raise error(f"{where}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise error(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


class HFConfig(Mapping):
    """A read-only view of a Hugging Face `config.json`."""

    def __init__(self, data: dict, path: Path | None = None):
        if not isinstance(data, dict):
            raise ConfigError(f"{path or 'config'}: expected a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type")
        if model_type is None and "d_model" in data and "n_layer" in data:
            model_type = _mamba_ssm_type(data)
        if not isinstance(model_type, str) or not model_type:
            raise ConfigError(f"{path or 'config'}: missing or invalid 'model_type' (got {shown(model_type)})")
        self._data = data
        self._model_type = model_type
        self.path = path

    @classmethod
    def from_json(cls, path) -> "HFConfig":
        """Read `config.json` from a checkpoint directory or an explicit file path."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json there")
        return cls(read_json(path), path)

    @property
    def model_type(self) -> str:
        return self._model_type

    @property
    def mamba_ssm_format(self) -> bool:
        """An original mamba_ssm config.json: no model_type, fields d_model, n_layer, ssm_cfg, ..."""
        return "model_type" not in self._data

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)

    def __repr__(self):
        return f"HFConfig({self.model_type!r}, path={str(self.path) if self.path else None!r})"


@dataclass(frozen=True)
class Family:
    """What a model_type fixes that its config does not say."""

    kind: str
    qkv_bias: bool | None = None  # None: the config's attention_bias decides
    o_bias: bool | None = None
    qk_norm: bool = False
    mlp_bias_field: bool = False  # the config's mlp_bias is honored
    window: str = "none"  # "none", "all" (every layer), or "per_layer" (use_sliding_window et al.)
    tie: bool = False  # tie_word_embeddings when the config leaves it out


FAMILIES = {
    "llama": Family(kind="transformer", mlp_bias_field=True),
    "mistral": Family(kind="transformer", qkv_bias=False, o_bias=False, window="all"),
    "qwen2": Family(kind="transformer", qkv_bias=True, o_bias=False, window="per_layer"),
    "qwen3": Family(kind="transformer", qk_norm=True, window="per_layer"),
    "mamba": Family(kind="mamba1", tie=True),
    "mamba2": Family(kind="mamba2"),
}

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class ModelPlan:
    """Everything needed to build and fill a model: sizes, block options, checkpoint names."""

    model_type: str
    family: str
    kind: str
    n_layers: int
    d_model: int
    vocab_size: int
    tie_embeddings: bool
    norm_eps: float
    max_position_embeddings: int | None
    block_options: dict
    embed_name: str
    norm_name: str
    head_name: str | None
    layer_prefix: str = "model.layers"
    layer_windows: tuple = field(default=())

    @property
    def block_kwargs(self) -> dict:
        """The block options beyond the shared interface: Mamba 2's dt_limit, else none."""
        return {"dt_limit": self.block_options["dt_limit"]} if self.kind == "mamba2" else {}

    def layer_weights(self, i: int) -> list[tuple[str, str, slice | None]]:
        """(block parameter, checkpoint tensor, rows of the block parameter it fills) for layer i."""
        if not 0 <= i < self.n_layers:
            raise IndexError(f"layer {i} out of range for {self.n_layers} layers")
        if self.kind == "transformer":
            return _transformer_weights(self, f"{self.layer_prefix}.{i}.")
        if self.kind in ("mamba1", "mamba2"):
            return _mamba_weights(self, f"{self.layer_prefix}.{i}.")
        raise UnsupportedModel(f"model kind {self.kind!r} has no weight layout")

    def weight_names(self) -> list[str]:
        """Every checkpoint tensor the plan reads, in load order."""
        names = [self.embed_name]
        for i in range(self.n_layers):
            names += [name for _, name, _ in self.layer_weights(i)]
        names.append(self.norm_name)
        if self.head_name:
            names.append(self.head_name)
        return names


def _transformer_weights(plan: ModelPlan, prefix: str) -> list:
    o = plan.block_options
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
    w = [("attn_norm.weight", prefix + "input_layernorm.weight", None)]
    w += fused("attn.qkv", qkv, "weight")
    if o["qkv_bias"]:
        w += fused("attn.qkv", qkv, "bias")
    w.append(("attn.o.weight", attn + "o_proj.weight", None))
    if o["o_bias"]:
        w.append(("attn.o.bias", attn + "o_proj.bias", None))
    if o["qk_norm"]:
        w += [("attn.q_norm.weight", attn + "q_norm.weight", None),
              ("attn.k_norm.weight", attn + "k_norm.weight", None)]
    w.append(("mlp_norm.weight", prefix + "post_attention_layernorm.weight", None))
    w += fused("mlp.gate_up", gate_up, "weight")
    if o["mlp_bias"]:
        w += fused("mlp.gate_up", gate_up, "bias")
    w.append(("mlp.down.weight", mlp + "down_proj.weight", None))
    if o["mlp_bias"]:
        w.append(("mlp.down.bias", mlp + "down_proj.bias", None))
    return w


def _mamba_weights(plan: ModelPlan, prefix: str) -> list:
    """Block parameters carry the checkpoint's own names below the layer prefix."""
    o = plan.block_options
    names = ["norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight"]
    if plan.kind == "mamba1":
        names += ["mixer.x_proj.weight", "mixer.dt_proj.weight", "mixer.dt_proj.bias"]
    else:
        names += ["mixer.dt_bias", "mixer.norm.weight"]
    names += ["mixer.A_log", "mixer.D", "mixer.out_proj.weight"]
    if o["bias"]:
        names += ["mixer.in_proj.bias", "mixer.out_proj.bias"]
    if o["conv_bias"]:
        names.append("mixer.conv1d.bias")
    keys = {"mixer.dt_proj.bias": "mixer.dt_bias"}  # Mamba 1's, kept float32 apart from its (re-storable) matrix
    return [(keys.get(name, name), prefix + name, None) for name in names]


class _Fields:
    """Typed, range-checked access to config fields; errors name the model_type and field."""

    def __init__(self, cfg: HFConfig, prefix: str = ""):
        self.cfg, self.model_type, self.prefix = cfg, cfg.model_type, prefix  # prefix: where a nested dict sits
        self.where = f"{cfg.path}: " if cfg.path else ""

    def _bad(self, key, value, expected):
        return ConfigError(
            f"{self.where}model_type {shown(self.model_type)}: field {shown(self.prefix + key)} = {shown(value)}, "
            f"expected {expected}")

    def int(self, key, default=None, *, minimum=1, maximum=MAX_WIDTH):
        value = self.cfg.get(key, default)
        if value is None and default is None:
            raise self._bad(key, None, "an integer (the field is required)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, value, "an integer")
        if not minimum <= value <= maximum:
            raise self._bad(key, value, f"an integer in [{minimum}, {maximum}]")
        return value

    def optional_int(self, key, *, minimum=1, maximum=MAX_POSITIONS):
        return None if self.cfg.get(key) is None else self.int(key, minimum=minimum, maximum=maximum)

    def eps(self, key, default):
        """A norm's epsilon: a normal float32 no larger than 1 (1e308 would flatten every norm's output to 0,
        a subnormal one be lost in the float32 sum it is added to)."""
        value = self.cfg.get(key, default)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not EPS_RANGE[0] <= value <= EPS_RANGE[1]):
            raise self._bad(key, value, f"a number in [{EPS_RANGE[0]:.3g}, {EPS_RANGE[1]}]")
        return float(value)

    def bool(self, key, default):
        value = self.cfg.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def str(self, key, default):
        value = self.cfg.get(key, default)
        if not isinstance(value, str):
            raise self._bad(key, value, "a string")
        return value

    def refuse(self, key, value, why):
        return UnsupportedModel(
            f"{self.where}model_type {shown(self.model_type)}: {self.prefix + key} = {shown(value)} is not supported "
            f"({why})")


def plan_for(config) -> ModelPlan:
    """Map a config (HFConfig or plain dict) onto a ModelPlan, or refuse by name."""
    cfg = config if isinstance(config, HFConfig) else HFConfig(config)
    if cfg.model_type not in FAMILIES:
        raise UnsupportedModel(
            f"{cfg.path or 'config'}: model_type {shown(cfg.model_type)} is not supported "
            f"(supported: {', '.join(sorted(FAMILIES))})")
    family = FAMILIES[cfg.model_type]
    if family.kind == "transformer":
        return _transformer_plan(_Fields(cfg), family)
    return _mamba_plan(_Fields(cfg), family)


def _transformer_plan(f: _Fields, family: Family) -> ModelPlan:
    d_model = f.int("hidden_size")
    n_layers = f.int("num_hidden_layers", maximum=MAX_LAYERS)
    n_heads = f.int("num_attention_heads", maximum=4096)
    n_kv_heads = f.int("num_key_value_heads", n_heads, maximum=4096)
    if n_heads % n_kv_heads:
        raise f._bad("num_key_value_heads", n_kv_heads, f"a divisor of num_attention_heads ({n_heads})")
    if f.cfg.get("head_dim") is None:
        if d_model % n_heads:
            raise f._bad("hidden_size", d_model,
                         f"a multiple of num_attention_heads ({n_heads}) when head_dim is absent")
        head_dim = d_model // n_heads
    else:
        head_dim = f.int("head_dim", maximum=4096)
    if head_dim % 2:
        raise f._bad("head_dim", head_dim, "an even number (rotary pairs)")

    act = f.str("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise f.refuse("hidden_act", act, f"supported: {', '.join(ACTIVATIONS)}")
    attention_bias = f.bool("attention_bias", False)
    qkv_bias = attention_bias if family.qkv_bias is None else family.qkv_bias
    o_bias = attention_bias if family.o_bias is None else family.o_bias
    if family.qkv_bias is not None and f.cfg.get("attention_bias") not in (None, False, family.qkv_bias):
        raise f.refuse("attention_bias", f.cfg.get("attention_bias"), f"{f.model_type} fixes its own biases")
    mlp_bias = f.bool("mlp_bias", False)
    if mlp_bias and not family.mlp_bias_field:
        raise f.refuse("mlp_bias", mlp_bias, f"{f.model_type} has no MLP biases")

    partial = f.cfg.get("partial_rotary_factor")
    rope = _rope(f)
    partial = rope.pop("partial_rotary_factor", partial)
    if partial not in (None, 1, 1.0):
        raise f.refuse("partial_rotary_factor", partial, "rotary embedding over the whole head only")
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "logits_scaling", "embedding_multiplier"):
        if f.cfg.get(key) not in (None, 1, 1.0):
            raise f.refuse(key, f.cfg.get(key), f"{f.model_type} does not use it")

    max_positions = f.optional_int("max_position_embeddings")
    windows = _layer_windows(f, family, n_layers)
    tie = f.bool("tie_word_embeddings", False)
    options = dict(
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        d_ff=f.int("intermediate_size", maximum=MAX_WIDTH * 8),
        act=act, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
        qk_norm=family.qk_norm, rope=rope, norm_eps=f.eps("rms_norm_eps", 1e-6),
    )
    return ModelPlan(
        model_type=f.model_type, family=f.model_type, kind=family.kind,
        n_layers=n_layers, d_model=d_model,
        vocab_size=f.int("vocab_size", maximum=MAX_VOCAB),
        tie_embeddings=tie, norm_eps=options["norm_eps"],
        max_position_embeddings=max_positions, block_options=options,
        embed_name="model.embed_tokens.weight", norm_name="model.norm.weight",
        head_name=None if tie else "lm_head.weight", layer_windows=windows,
    )


def _rope(f: _Fields) -> dict:
    """Normalize `rope_theta` + `rope_scaling` (legacy) and `rope_parameters` (transformers 5) to one dict."""
    params = f.cfg.get("rope_parameters")
    legacy = f.cfg.get("rope_scaling")
    source = "rope_parameters" if params is not None else "rope_scaling"
    spec = params if params is not None else legacy
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise f._bad(source, spec, "an object")
    if any(isinstance(v, dict) for v in spec.values()):
        raise f.refuse(source, sorted(spec), "rotary settings per layer type")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise f.refuse(f"{source}.rope_type", kind, f"supported: {', '.join(ROPE_TYPES)}")
    theta = spec.get("rope_theta", f.cfg.get("rope_theta", 10000.0))
    if (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta)
            or theta < MIN_ROPE_THETA):
        raise f._bad("rope_theta", theta, f"a finite number >= {MIN_ROPE_THETA}")
    rope = {"type": kind, "theta": float(theta)}
    if "partial_rotary_factor" in spec:
        rope["partial_rotary_factor"] = spec["partial_rotary_factor"]

    def number(key, default=None):
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise f._bad(f"{source}.{key}", value, "a positive number")
        return value

    if kind in ("linear", "llama3", "yarn"):
        rope["factor"] = number("factor")
    if kind in ("llama3", "yarn"):
        original = spec.get("original_max_position_embeddings", f.cfg.get("max_position_embeddings"))
        rope["original_max_position_embeddings"] = number("original_max_position_embeddings", original)
    if kind == "llama3":
        rope["low_freq_factor"] = number("low_freq_factor")
        rope["high_freq_factor"] = number("high_freq_factor")
        if rope["high_freq_factor"] <= rope["low_freq_factor"]:
            raise f._bad(f"{source}.high_freq_factor", rope["high_freq_factor"], "greater than low_freq_factor")
    if kind == "yarn":
        for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if spec.get(key) is not None:
                rope[key] = number(key)
        rope["truncate"] = spec.get("truncate", True)
    return rope


def _layer_windows(f: _Fields, family: Family, n_layers: int) -> tuple:
    """The sliding-window length of each layer (None: full attention), as transformers builds it."""
    if family.window == "none":
        return (None,) * n_layers
    window = f.optional_int("sliding_window", maximum=MAX_POSITIONS)
    if family.window == "all":
        return (window,) * n_layers
    if not f.bool("use_sliding_window", False):
        window = None
    layer_types = f.cfg.get("layer_types")
    if layer_types is None:
        first = f.int("max_window_layers", n_layers, minimum=0, maximum=MAX_LAYERS)
        return tuple(window if window is not None and i >= first else None for i in range(n_layers))
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise f._bad("layer_types", layer_types, f"a list of {n_layers} layer types")
    out = []
    for kind in layer_types:
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            if window is None:
                raise f._bad("layer_types", kind, "full_attention when sliding_window is off")
            out.append(window)
        else:
            raise f.refuse("layer_types", kind, "supported: full_attention, sliding_attention")
    return tuple(out)


def _mamba_plan(f: _Fields, family: Family) -> ModelPlan:
    """Mamba 1 and Mamba 2 stacks, as transformers' MambaForCausalLM / Mamba2ForCausalLM compute them.

    time_step_min/max/floor/scale/init_scheme, rescale_prenorm_residual and initializer_range only shape a
    random init, and use_mambapy / use_associative_scan only pick transformers' scan code: all are ignored.
    """
    embed_name = "backbone.embeddings.weight"
    if f.cfg.mamba_ssm_format:
        f, embed_name = _Fields(_from_mamba_ssm(f)), "backbone.embedding.weight"
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
    return ModelPlan(
        model_type=f.model_type, family=f.model_type, kind=family.kind,
        n_layers=f.int("num_hidden_layers", maximum=MAX_LAYERS), d_model=d_model,
        vocab_size=f.int("vocab_size", maximum=MAX_VOCAB),
        tie_embeddings=tie, norm_eps=options["norm_eps"],
        max_position_embeddings=None, block_options=options,
        embed_name=embed_name, norm_name="backbone.norm_f.weight",
        head_name=None if tie else "lm_head.weight", layer_prefix="backbone.layers",
    )


def _mamba2_options(f: _Fields, d_inner: int) -> dict:
    """Heads, groups, chunking and the dt clamp of a Mamba 2 mixer.

    norm_before_gate is ignored, as transformers ignores it: its Mamba2 always multiplies the gate in before
    the gated RMSNorm, which is mamba_ssm's default and how released checkpoints were trained (their HF
    configs often carry a stale `norm_before_gate: true`). mamba_ssm-format configs that set it are refused.
    """
    n_heads = f.int("num_heads", 128)
    head_dim = f.int("head_dim", 64)
    if n_heads * head_dim != d_inner:
        raise f._bad("num_heads", n_heads, f"num_heads * head_dim ({head_dim}) == expand * hidden_size ({d_inner})")
    n_groups = f.int("n_groups", 8)
    if n_heads % n_groups:
        raise f._bad("n_groups", n_groups, f"a divisor of num_heads ({n_heads})")
    if not f.bool("rms_norm", True):
        raise f.refuse("rms_norm", False, "the gated RMSNorm before out_proj is always applied, as in transformers")
    limit = f.cfg.get("time_step_limit", (0.0, math.inf))
    if isinstance(limit, (list, tuple)):
        limit = [_json_float(v) for v in limit]
    if (not isinstance(limit, (list, tuple)) or len(limit) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) for v in limit)
            or not 0 <= limit[0] <= limit[1]):
        raise f._bad("time_step_limit", limit, "[low, high] with 0 <= low <= high")
    return dict(n_heads=n_heads, head_dim=head_dim, n_groups=n_groups,
                chunk_size=f.int("chunk_size", 256, maximum=1 << 16), dt_limit=(float(limit[0]), float(limit[1])))


def _json_float(value):
    """transformers 5 writes inf and nan as {"__float__": "Infinity"}; older saves as bare Infinity."""
    special = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
    if isinstance(value, dict) and value.keys() == {"__float__"} and str(value["__float__"]) in special:
        return special[value["__float__"]]
    return value


def _mamba_ssm_type(data: dict) -> str:
    """The model_type an original mamba_ssm config stands for: ssm_cfg.layer, Mamba1 when absent."""
    ssm = data.get("ssm_cfg")
    return "mamba2" if isinstance(ssm, dict) and ssm.get("layer") == "Mamba2" else "mamba"


def _from_mamba_ssm(f: _Fields) -> HFConfig:
    """An original mamba_ssm config (d_model, n_layer, ssm_cfg, ...) in transformers' field names.

    mamba_ssm pads the vocabulary to a multiple of pad_vocab_size_multiple and fixes both norm epsilons at
    1e-5; fused_add_norm only fuses kernels. What has no transformers equivalent is refused here by name.
    """
    cfg = f.cfg
    ssm = cfg.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        raise f._bad("ssm_cfg", ssm, "an object")
    s = _Fields(HFConfig({**ssm, "model_type": f.model_type}, cfg.path), prefix="ssm_cfg.")
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
        raise s._bad("headdim", head_dim, f"a divisor of expand * d_model ({d_inner})")
    for key, default, why in (("rmsnorm", True, "the gated RMSNorm is always applied"),
                              ("norm_before_gate", False, "the gate is applied before the norm"),
                              ("D_has_hdim", False, "D holds one value per head")):
        if s.bool(key, default) != default:
            raise s.refuse(key, not default, why)
    out.update(num_heads=d_inner // head_dim, head_dim=head_dim, n_groups=s.int("ngroups", 1),
               chunk_size=s.int("chunk_size", 256, maximum=1 << 16),
               time_step_limit=ssm.get("dt_limit", (0.0, math.inf)))
    return HFConfig(out, cfg.path)
