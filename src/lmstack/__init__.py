"""lmstack: run Hugging Face-format causal language models from their checkpoint directory."""

from .checkpoint import Checkpoint, CheckpointError, SafetensorsFile
from .config import FAMILIES, ConfigError, HFConfig, ModelPlan, UnsupportedModel, plan_for
from .gguf import GGUFFile
from .model import CausalLM, CausalLMState
from .parallel import ParallelCausalLM, PipelineCausalLM
from .sampling import Sampler, TextStream, generate_text, stream_text
from .tokenizer import PATTERNS, Tokenizer, TokenizerError

__all__ = [
    "CausalLM", "CausalLMState", "Checkpoint", "CheckpointError", "ConfigError", "FAMILIES", "GGUFFile", "HFConfig",
    "ModelPlan", "PATTERNS", "ParallelCausalLM", "PipelineCausalLM", "SafetensorsFile", "Sampler", "TextStream",
    "Tokenizer", "TokenizerError", "UnsupportedModel", "generate_text", "plan_for", "stream_text",
]
