"""What every family module is made of: typed config fields, the Family record, the GGUF architecture record."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import EPS_RANGE, MAX_POSITIONS, MAX_WIDTH, ConfigError, HFConfig, UnsupportedModel, shown

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # every family's; LongRoPE only where a family declares it


@dataclass(frozen=True)
class Family:
    """A model_type: the function that plans it, and what it fixes that its config does not say."""

    kind: str  # "transformer", "mamba1" or "mamba2": the blocks the plan builds
    plan: Callable  # (Fields, Family) -> ModelPlan
    qkv_bias: bool | None = None  # None: the config's attention_bias decides
    o_bias: bool | None = None
    qk_norm: bool = False
    mlp_bias_field: bool = False  # the config's mlp_bias is honored
    window: str = "none"  # "none", "all" (every layer), or "per_layer" (use_sliding_window et al.)
    tie: bool = False  # tie_word_embeddings when the config leaves it out
    partial_rotary: bool = False  # the reference rotates partial_rotary_factor of each head, passing the rest
    rope_types: tuple = ROPE_TYPES  # the rope types its reference computes


@dataclass(frozen=True)
class GGUFArchitecture:
    """A GGUF `general.architecture`: the model_type it stands for, its metadata as a config.json, its tensor names."""

    model_type: str
    hf_class: str  # the transformers class `lmstack convert` names in config.json
    config: Callable  # (GGUFFile) -> the config.json a Hugging Face checkpoint of the same model would carry
    names: dict  # GGUF tensor stem outside the layers -> Hugging Face stem
    layer_names: dict  # GGUF stem within blk.N -> Hugging Face stem within model.layers.N
    permuted_qk: bool = False  # llama.cpp's converter interleaved the q/k rows for its rotary layout
    norm_offset: float = 0.0  # llama.cpp's converter stored each norm weight plus this: subtracted on read
    layer_prefix: str = "model.layers"
    expert_names: dict = field(default_factory=dict)  # GGUF stem within blk.N of a tensor stacking the layer's
    # experts -> the Hugging Face stem of one expert's, "{e}" standing for its index (families/moe.py)

    def expert_name(self, name: str) -> str | None:
        """The Hugging Face name of one expert's share of a GGUF tensor that stacks a layer's experts, "{e}"
        standing for the expert; None for any other tensor."""
        stem, _, suffix = name.rpartition(".")
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.expert_names:
            return f"{self.layer_prefix}.{parts[1]}.{self.expert_names[parts[2]]}.{suffix}"
        return None

    def hf_name(self, name: str) -> str:
        """The Hugging Face checkpoint name of a GGUF tensor name; unknown names stay as they are."""
        stem, _, suffix = name.rpartition(".")
        if stem in self.names:
            return f"{self.names[stem]}.{suffix}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.layer_names:
            return f"{self.layer_prefix}.{parts[1]}.{self.layer_names[parts[2]]}.{suffix}"
        if (len(parts) == 4 and parts[0] == "blk" and f"{parts[2]}_exps" in self.expert_names
                and parts[3].isascii() and parts[3].isdigit()):  # blk.N.ffn_gate.E: older files' one tensor an expert
            expert = self.expert_names[f"{parts[2]}_exps"].replace("{e}", str(int(parts[3])))
            return f"{self.layer_prefix}.{parts[1]}.{expert}.{suffix}"
        return name


@dataclass
class Fields:
    """Typed, range-checked access to config fields; errors name the model_type and field."""

    cfg: HFConfig
    prefix: str = ""  # where a nested dict sits
    model_type: str = field(init=False)
    where: str = field(init=False)

    def __post_init__(self):
        self.model_type = self.cfg.model_type
        self.where = f"{self.cfg.path}: " if self.cfg.path else ""

    def bad(self, key, value, expected):
        return ConfigError(
            f"{self.where}model_type {shown(self.model_type)}: field {shown(self.prefix + key)} = {shown(value)}, "
            f"expected {expected}")

    def int(self, key, default=None, *, minimum=1, maximum=MAX_WIDTH):
        value = self.cfg.get(key, default)
        if value is None and default is None:
            raise self.bad(key, None, "an integer (the field is required)")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.bad(key, value, "an integer")
        if not minimum <= value <= maximum:
            raise self.bad(key, value, f"an integer in [{minimum}, {maximum}]")
        return value

    def optional_int(self, key, *, minimum=1, maximum=MAX_POSITIONS):
        return None if self.cfg.get(key) is None else self.int(key, minimum=minimum, maximum=maximum)

    def number(self, key, default=None, *, minimum=0.0, maximum=math.inf):
        """A finite number in (minimum, maximum]; absent or null: `default`."""
        value = self.cfg.get(key)
        if value is None:
            return default
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not minimum < value <= maximum):
            raise self.bad(key, value, f"a number in ({minimum}, {maximum}]")
        return float(value)

    def eps(self, key, default):
        """A norm's epsilon: a normal float32 no larger than 1 (1e308 would flatten every norm's output to 0,
        a subnormal one be lost in the float32 sum it is added to)."""
        value = self.cfg.get(key, default)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not EPS_RANGE[0] <= value <= EPS_RANGE[1]):
            raise self.bad(key, value, f"a number in [{EPS_RANGE[0]:.3g}, {EPS_RANGE[1]}]")
        return float(value)

    def bool(self, key, default):
        value = self.cfg.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.bad(key, value, "true or false")
        return value

    def str(self, key, default):
        value = self.cfg.get(key, default)
        if not isinstance(value, str):
            raise self.bad(key, value, "a string")
        return value

    def refuse(self, key, value, why):
        return UnsupportedModel(
            f"{self.where}model_type {shown(self.model_type)}: {self.prefix + key} = {shown(value)} is not supported "
            f"({why})")
