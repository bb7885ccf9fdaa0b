"""Mixtures of experts: Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B) and Mixtral (`mixtral`), Llama's
stack whose MLP is, in some layers or all, a MixtureOfExperts (blocks/transformer.py), as transformers computes them.

- Qwen3-MoE: q/k norms; the softmax over all experts, the top num_experts_per_tok, renormalized where
  norm_topk_prob; layer i is a mixture unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0, when
  it is a dense MLP of intermediate_size; experts of moe_intermediate_size; sliding_window in every layer where
  use_sliding_window (max_window_layers is not read, as transformers does not).
- Mixtral: the top num_experts_per_tok (2) of num_local_experts (8), renormalized, the weights kept in float32;
  experts of intermediate_size; one sliding window in every layer where it is set.

Checkpoints name each expert's projections (`mlp.experts.N.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.N.w1.weight`), which transformers 5's save_pretrained writes too. GGUF stacks a layer's
experts in one tensor (ffn_gate_exps, ffn_up_exps, ffn_down_exps), which gguf.py reads an expert at a time.
Shared experts (Qwen2-MoE, DeepSeek) and OLMoE (q/k norms over all heads at once) are refused by name.
"""

import dataclasses

from ..config import MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, MAX_WIDTH, UnsupportedModel, shown
from . import transformer
from .base import Family, Fields, GGUFArchitecture

# block parameter name within an expert -> the checkpoint's, and where the router and experts sit in a layer
NAMES = {
    "qwen3_moe": dict(block="mlp.", gate="gate_proj", up="up_proj", down="down_proj"),
    "mixtral": dict(block="block_sparse_moe.", gate="w1", up="w3", down="w2"),
}


def plan(f: Fields, family: Family):
    qwen = f.model_type == "qwen3_moe"
    options = transformer.attention_options(f, family)
    n_layers = f.int("num_hidden_layers", maximum=MAX_LAYERS)
    n_experts = _n_experts(f, qwen)
    options["experts"] = dict(
        n_experts=n_experts,
        top_k=f.int("num_experts_per_tok", 8 if qwen else 2, maximum=n_experts) if n_experts else 0,  # 0: all dense
        d_ff=f.int("moe_intermediate_size", 768, maximum=MAX_WIDTH * 8) if qwen else options["d_ff"],
        norm_topk_prob=f.bool("norm_topk_prob", False) if qwen else True,
        float32_weights=not qwen,
    )
    layers = _mixture_layers(f, n_layers, n_experts) if qwen else (True,) * n_layers
    base = transformer.make_plan(f, family, options, n_layers, _windows(f, family, n_layers), layer_experts=layers)
    names = NAMES[f.model_type]
    tensors = tuple(
        tuple(t for t in base.layer_tensors[i] if not t[0].startswith("mlp.")) + expert_tensors(options, i, names)
        if layers[i] else base.layer_tensors[i] for i in range(n_layers))
    return dataclasses.replace(base, layer_tensors=tensors)


def _windows(f: Fields, family: Family, n_layers: int) -> tuple:
    """Mixtral slides sliding_window in every layer; transformers' Qwen3-MoE too, where use_sliding_window (unlike
    Qwen 3, it reads no max_window_layers or layer_types)."""
    if f.model_type == "mixtral":
        return transformer.layer_windows(f, family, n_layers)
    if f.cfg.get("layer_types") is not None:
        raise f.refuse("layer_types", f.cfg["layer_types"], "transformers' Qwen3-MoE slides every layer or none "
                       "(use_sliding_window)")
    window = f.optional_int("sliding_window", maximum=MAX_POSITIONS)
    return (window if f.bool("use_sliding_window", False) else None,) * n_layers


def _n_experts(f: Fields, qwen: bool) -> int:
    """num_local_experts, or Qwen3-MoE's num_experts (its published configs' name; transformers saves the other)."""
    if not qwen:
        return f.int("num_local_experts", 8, maximum=MAX_EXPERTS)
    given = {key: f.int(key, minimum=0, maximum=MAX_EXPERTS) for key in ("num_experts", "num_local_experts")
             if f.cfg.get(key) is not None}
    if len(set(given.values())) > 1:
        raise f.bad("num_local_experts", given["num_local_experts"], f"num_experts ({given['num_experts']})")
    return next(iter(given.values()), 128)


def _mixture_layers(f: Fields, n_layers: int, n_experts: int) -> tuple:
    """Whether each layer's MLP is the mixture, as transformers' Qwen3MoeDecoderLayer decides."""
    step = f.int("decoder_sparse_step", 1, maximum=MAX_LAYERS)
    dense = f.cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(type(i) is int and 0 <= i < n_layers for i in dense):
        raise f.bad("mlp_only_layers", dense, f"a list of layer indices in [0, {n_layers})")
    return tuple(i not in dense and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers))


def expert_tensors(o: dict, i: int, names: dict) -> tuple:
    """(block parameter, checkpoint tensor, rows it fills) of layer i's router and experts: each expert's gate and
    up fill its one gate_up parameter."""
    ff = o["experts"]["d_ff"]
    block = f"model.layers.{i}.{names['block']}"
    out = [("mlp.router.weight", f"{block}gate.weight", None)]
    for e in range(o["experts"]["n_experts"]):
        expert = f"{block}experts.{e}."
        out += [(f"mlp.experts.{e}.gate_up.weight", f"{expert}{names['gate']}.weight", slice(0, ff)),
                (f"mlp.experts.{e}.gate_up.weight", f"{expert}{names['up']}.weight", slice(ff, 2 * ff)),
                (f"mlp.experts.{e}.down.weight", f"{expert}{names['down']}.weight", None)]
    return tuple(out)


def _refuse_shared_experts(f: Fields, family: Family):
    raise UnsupportedModel(
        f"{f.where}model_type {shown(f.model_type)} is not supported: its mixture adds shared experts to the "
        f"routed ones (lmstack runs the mixtures of qwen3_moe and mixtral)")


def _refuse_olmoe(f: Fields, family: Family):
    raise UnsupportedModel(
        f"{f.where}model_type {shown(f.model_type)} is not supported: its q/k RMSNorms span all heads at once "
        f"(lmstack's normalize each head, as Qwen 3's)")


FAMILIES = {
    "qwen3_moe": Family(kind="transformer", plan=plan, qk_norm=True),
    "mixtral": Family(kind="transformer", plan=plan, qkv_bias=False, o_bias=False, window="all"),
    "qwen2_moe": Family(kind="transformer", plan=_refuse_shared_experts),
    "deepseek_v2": Family(kind="transformer", plan=_refuse_shared_experts),
    "deepseek_v3": Family(kind="transformer", plan=_refuse_shared_experts),
    "olmoe": Family(kind="transformer", plan=_refuse_olmoe),
}

# llama.cpp's names of a layer's router and stacked experts -> Hugging Face's ("{e}": the expert)
GGUF_EXPERT_NAMES = {
    "qwen3_moe": {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                  "ffn_down_exps": "mlp.experts.{e}.down_proj"},
    "mixtral": {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1", "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
}
GGUF_ROUTER_NAMES = {"qwen3_moe": {"ffn_gate_inp": "mlp.gate"}, "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"}}


def gguf_config(file, model_type: str) -> dict:
    """llama.cpp's metadata of a mixture as transformers' config: llama.cpp renormalizes the chosen experts'
    weights for both (its qwen3moe and llama graphs), and a qwen3moe layer without a router is a dense MLP."""
    config = transformer.gguf_config(file, model_type, experts=True)
    n_experts = file._int("{arch}.expert_count")
    config["num_experts_per_tok"] = file._int("{arch}.expert_used_count")
    if model_type == "mixtral":
        config["num_local_experts"] = n_experts
        config["architectures"] = ["MixtralForCausalLM"]  # `lmstack convert`'s class, not the architecture's
        return config
    config["num_experts"] = n_experts
    config["moe_intermediate_size"] = file._int("{arch}.expert_feed_forward_length")
    config["norm_topk_prob"] = True
    n_layers = config["num_hidden_layers"]
    if isinstance(n_layers, int) and 0 < n_layers <= MAX_LAYERS:
        config["mlp_only_layers"] = [i for i in range(n_layers) if f"model.layers.{i}.mlp.gate.weight" not in file]
    return config


GGUF = {"qwen3moe": GGUFArchitecture(
    model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM", config=lambda file: gguf_config(file, "qwen3_moe"),
    names=transformer.GGUF_NAMES, layer_names={**transformer.GGUF_LAYER_NAMES, **GGUF_ROUTER_NAMES["qwen3_moe"]},
    expert_names=GGUF_EXPERT_NAMES["qwen3_moe"])}
