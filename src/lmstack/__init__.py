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

import gc as _gc

# Importing torch makes about a million objects and no garbage: the collector's passes over them as they are made
# took a fifth of a second of every start. It runs again once the imports are done.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from .checkpoint import Checkpoint, CheckpointError, SafetensorsFile
    from .config import FAMILIES, ConfigError, HFConfig, ModelPlan, UnsupportedModel, plan_for
    from .gguf import GGUFFile
    from .lookup import PromptLookupError
    from .model import CausalLM, CausalLMState
    from .parallel import ParallelCausalLM, PipelineCausalLM
    from .perplexity import Perplexity, perplexity
    from .sampling import Sampler, TextStream, generate_text, stream_text
    from .tokenizer import PATTERNS, Tokenizer, TokenizerError
finally:
    if _collecting:
        _gc.enable()

__all__ = [
    "CausalLM", "CausalLMState", "Checkpoint", "CheckpointError", "ConfigError", "FAMILIES", "GGUFFile", "HFConfig",
    "ModelPlan", "PATTERNS", "ParallelCausalLM", "Perplexity", "PipelineCausalLM", "PromptLookupError",
    "SafetensorsFile", "Sampler", "TextStream", "Tokenizer", "TokenizerError", "UnsupportedModel", "generate_text",
    "perplexity", "plan_for", "stream_text",
]
