"""The registry of families: model_type -> Family, GGUF architecture -> GGUFArchitecture, and `plan_for`.

A family is one module here holding all it knows: its config fields -> plan with its refusals by name,
its Hugging Face tensor names, its GGUF architectures, metadata keys and tensor names. Adding a family is
one new module listed in MODULES, plus its tests; nothing else learns its name. A module's REFUSED names
the model_types it knows and does not run, with the reason.
"""

from ..config import HFConfig, ModelPlan, UnsupportedModel, shown
from . import gemma, llama, mamba, moe, phi3, qwen
from .base import Family, Fields, GGUFArchitecture

MODULES = (llama, qwen, gemma, phi3, moe, mamba)
FAMILIES: dict[str, Family] = {name: family for m in MODULES for name, family in m.FAMILIES.items()}
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    name: arch for m in MODULES for name, arch in getattr(m, "GGUF", {}).items()}
REFUSED: dict[str, str] = {name: why for m in MODULES for name, why in getattr(m, "REFUSED", {}).items()}


def plan_for(config) -> ModelPlan:
    """Map a config (HFConfig or plain dict) onto a ModelPlan through its family, or refuse by name."""
    cfg = config if isinstance(config, HFConfig) else HFConfig(config)
    if cfg.model_type in REFUSED:
        raise UnsupportedModel(f"{cfg.path or 'config'}: model_type {shown(cfg.model_type)} is not supported "
                               f"({REFUSED[cfg.model_type]})")
    if cfg.model_type not in FAMILIES:
        raise UnsupportedModel(
            f"{cfg.path or 'config'}: model_type {shown(cfg.model_type)} is not supported "
            f"(supported: {', '.join(sorted(FAMILIES))})")
    family = FAMILIES[cfg.model_type]
    return family.plan(Fields(cfg), family)


__all__ = ["FAMILIES", "GGUF_ARCHITECTURES", "Family", "GGUFArchitecture", "plan_for"]
