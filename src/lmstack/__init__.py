"""lmstack: run Hugging Face-format causal language models from their checkpoint directory.

Errors. Every file is read as if a stranger wrote it: checked before use, refused before anything it
claims is allocated, never executed (no pickle, torch.load, eval/exec or remote code). Each message
names the file, the field or tensor, and what was expected.

    UnsupportedModel (ValueError)  well formed, but not something lmstack runs: a model_type, rope type,
                                   safetensors dtype (F8_*, U32, ...), GGUF architecture or tensor type
    ConfigError (ValueError)       config.json (or a GGUF's model metadata as config) malformed: not JSON,
                                   a key twice, a field of the wrong type or range, sizes that disagree
    CheckpointError (ValueError)   a .safetensors file, shard index or GGUF file malformed, or lacking,
                                   mis-shaping or mistyping a tensor the config needs; a shard path that
                                   leaves the checkpoint directory
    TokenizerError (ValueError)    tokenizer.json, tokenizer_config.json or a chat template malformed,
                                   or the template failing (its sandbox refusing an escape included)
    FileNotFoundError              a path, config.json, shard or tokenizer.json that does not exist
    ValueError, TypeError          a bad argument: ids, text that is not UTF-8 or that the vocabulary
                                   cannot encode, device, weight format, state, positions
    KeyError                       a tensor name that a checkpoint does not hold (info, read)
"""

import importlib as _importlib
import sys as _sys
import types as _types

from .memory import collector_paused as _collector_paused

# Each name is imported from its module when first used: `lmstack generate` starts work of its own before torch
# is imported (launch.py), and importing torch is a second of every start.
_MODULES = {
    "Checkpoint": "checkpoint", "CheckpointError": "checkpoint", "SafetensorsFile": "checkpoint",
    "FAMILIES": "config", "ConfigError": "config", "HFConfig": "config", "ModelPlan": "config",
    "UnsupportedModel": "config", "plan_for": "config", "GGUFFile": "gguf", "PromptLookupError": "lookup",
    "CausalLM": "model", "CausalLMState": "model", "ParallelCausalLM": "parallel", "PipelineCausalLM": "parallel",
    "Perplexity": "perplexity", "perplexity": "perplexity", "Sampler": "sampling", "TextStream": "sampling",
    "generate_text": "sampling", "stream_text": "sampling", "PATTERNS": "tokenizer", "Tokenizer": "tokenizer",
    "TokenizerError": "tokenizer",
}
__all__ = sorted(_MODULES, key=str.casefold)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'lmstack' has no attribute {name!r}")
    with _collector_paused():
        value = getattr(_importlib.import_module(f".{_MODULES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_MODULES})


class _Package(_types.ModuleType):
    def __setattr__(self, name, value):
        """Importing the submodule lmstack.perplexity binds it here, where `perplexity` is its function."""
        if name == "perplexity" and isinstance(value, _types.ModuleType):
            value = value.perplexity
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
