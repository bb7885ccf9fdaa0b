"""config.json as read (HFConfig), the plan a family makes of it (ModelPlan), and the errors both raise.

What each model_type means lives in its family module (families/); `plan_for` and `FAMILIES` are
re-exported here, so that `lmstack.config` stays the one import for configs and plans.
"""

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Sizes beyond these are refused before anything is allocated: no released model comes close.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 17
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 24
MAX_EXPERTS = 4096  # experts in one layer (the largest released mixtures have 384)
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


def _mamba_ssm_type(data: dict) -> str:
    """The model_type an original mamba_ssm config stands for: ssm_cfg.layer, Mamba1 when absent."""
    ssm = data.get("ssm_cfg")
    return "mamba2" if isinstance(ssm, dict) and ssm.get("layer") == "Mamba2" else "mamba"


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
    embed_scale: float | None = None  # the embedding's rows multiplied by it, in the model's dtype (Gemma)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma)
    layer_tensors: tuple = field(default=(), repr=False)  # per layer: ((block parameter, checkpoint tensor, rows), ...)
    layer_windows: tuple = field(default=())
    layer_experts: tuple = field(default=())  # per layer: whether its MLP is the mixture of experts (empty: none is)

    @property
    def block_kwargs(self) -> dict:
        """The block options beyond the shared interface: Mamba 2's dt_limit, else none."""
        return {"dt_limit": self.block_options["dt_limit"]} if self.kind == "mamba2" else {}

    def layer_weights(self, i: int) -> list[tuple[str, str, slice | None]]:
        """(block parameter, checkpoint tensor, rows of the block parameter it fills) for layer i."""
        if not 0 <= i < self.n_layers:
            raise IndexError(f"layer {i} out of range for {self.n_layers} layers")
        return list(self.layer_tensors[i])

    def weight_names(self) -> list[str]:
        """Every checkpoint tensor the plan reads, in load order."""
        names = [self.embed_name]
        for i in range(self.n_layers):
            names += [name for _, name, _ in self.layer_weights(i)]
        names.append(self.norm_name)
        if self.head_name:
            names.append(self.head_name)
        return names


from .families import FAMILIES, plan_for  # noqa: E402  (the families build on the classes above)
