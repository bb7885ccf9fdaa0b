"""lmstack: run Hugging Face-format causal language models from their checkpoint directory."""

from .checkpoint import Checkpoint, CheckpointError, SafetensorsFile
from .config import FAMILIES, ConfigError, HFConfig, ModelPlan, UnsupportedModel, plan_for
from .model import CausalLM, CausalLMState
from .parallel import ParallelCausalLM, PipelineCausalLM

__all__ = [
    "CausalLM", "CausalLMState", "Checkpoint", "CheckpointError", "ConfigError", "FAMILIES", "HFConfig",
    "ModelPlan", "ParallelCausalLM", "PipelineCausalLM", "SafetensorsFile", "UnsupportedModel", "plan_for",
]
