"""Mixtures of experts beyond the parity tests (test_parity.py runs the qwen3_moe and mixtral VARIANTS): the plan's
layers and refusals, only the chosen experts run, every weight format against transformers on the weights it
stores, GGUF files with stacked experts as llama.cpp's converter writes them, and `lmstack info`."""

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from lmstack import CausalLM, UnsupportedModel, kernels, plan_for
from lmstack.blocks.transformer import MixtureOfExperts, TransformerBlock
from lmstack.config import ConfigError
from lmstack.families.moe import NAMES
from lmstack.formats import GGUFLinear, Int4Linear, Int8Linear, MatvecLinear, row_invariant
from lmstack.gguf import GGUFFile
from test_fused_layer import stacked
from test_gguf import finish, gguf_writer, permute, tiny_vocab

QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32)
IDS = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))


def worst_delta(out, ref) -> float:
    return float((out - ref).abs().max() / max(1.0, float(ref.abs().max())))


def test_qwen3_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    plan = plan_for({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert plan.layer_experts == (False, True, False, False, False, True)  # (i + 1) % 2 == 0, less layer 3
    e = plan.block_options["experts"]
    assert (e["n_experts"], e["top_k"], e["d_ff"], e["norm_topk_prob"], e["float32_weights"]) == (8, 2, 32, False, False)
    names = [name for _, name, _ in plan.layer_weights(1)]
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert not any(".experts." in name for _, name, _ in plan.layer_weights(0))
    assert "model.layers.0.mlp.gate_proj.weight" in [name for _, name, _ in plan.layer_weights(0)]
    assert not any(plan_for({**QWEN3_MOE, "num_experts": 0}).layer_experts)  # transformers: every layer dense
    mixtral = plan_for({**QWEN3_MOE, "model_type": "mixtral", "num_local_experts": 4})
    assert all(mixtral.layer_experts) and mixtral.block_options["experts"]["norm_topk_prob"]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in [n for _, n, _ in mixtral.layer_weights(0)]
    assert mixtral.block_options["experts"]["d_ff"] == 96  # Mixtral's experts are intermediate_size wide


@pytest.mark.parametrize("changes, error, words", [
    (dict(model_type="qwen2_moe"), UnsupportedModel, "shared experts"),
    (dict(model_type="deepseek_v3"), UnsupportedModel, "shared experts"),
    (dict(model_type="olmoe"), UnsupportedModel, "span all heads"),
    (dict(layer_types=["full_attention"] * 6), UnsupportedModel, "layer_types"),
    (dict(num_local_experts=4), ConfigError, "num_local_experts"),  # disagrees with num_experts
    (dict(num_experts_per_tok=9), ConfigError, "num_experts_per_tok"),
    (dict(mlp_only_layers=[6]), ConfigError, "mlp_only_layers"),
    (dict(num_experts=5000), ConfigError, "num_experts"),
])
def test_refusals_name_the_field(changes, error, words):
    with pytest.raises(error, match=words):
        plan_for({**QWEN3_MOE, **changes})


def count_expert_calls(lm, monkeypatch) -> list:
    """(layer, expert, rows) of each call of an expert's forward, appended as they come."""
    calls = []
    for i, block in enumerate(lm.blocks):
        if isinstance(block.mlp, MixtureOfExperts):
            for e, expert in enumerate(block.mlp.experts):
                forward = expert.forward
                monkeypatch.setattr(expert, "forward", lambda x, i=i, e=e, f=forward: calls.append((i, e, len(x))) or f(x))
    return calls


def test_a_decode_step_runs_only_the_chosen_experts_and_a_prefill_each_expert_once(tiny_checkpoint, monkeypatch):
    lm = CausalLM.load(tiny_checkpoint("qwen3_moe_norm")[0], device="cpu")
    monkeypatch.setattr(TransformerBlock, "fusable", lambda self, x, ctx: False)  # the experts' Python calls
    calls = count_expert_calls(lm, monkeypatch)
    top_k = lm.plan.block_options["experts"]["top_k"]
    state = lm.allocate_state(1, 16)
    lm.forward(IDS[:1, :9], state)
    for layer in (1,):  # decoder_sparse_step 2: layer 1 of 3
        prefill = [(e, n) for i, e, n in calls if i == layer]
        assert len({e for e, _ in prefill}) == len(prefill)  # each expert once, on the tokens that chose it
        assert sum(n for _, n in prefill) == 9 * top_k
    calls.clear()
    lm.step(IDS[:1, 9], state)
    assert sorted(n for _, _, n in calls) == [1] * top_k  # one row through each of the top_k experts, no other


@pytest.mark.skipif(not kernels.available(), reason="the fused block needs the kernels")
def test_a_fused_decode_step_reads_only_the_chosen_experts(tiny_checkpoint, monkeypatch):
    """The fused step (kernels_layer.cpp) gives the blocks' Python logits with every expert the step did not choose
    (as the Python path's calls say) poisoned with NaN: it read none of them."""
    lm = CausalLM.load(tiny_checkpoint("qwen3_moe")[0], device="cpu")
    state = lm.allocate_state(1, 16)
    lm.forward(IDS[:1, :9], state)
    with monkeypatch.context() as patch:
        patch.setattr(TransformerBlock, "fusable", lambda self, x, ctx: False)
        calls = count_expert_calls(lm, patch)
        python = lm.step(IDS[:1, 9], state)
    chosen = {(i, e) for i, e, _ in calls}
    for i, block in enumerate(lm.blocks):
        if isinstance(block.mlp, MixtureOfExperts):
            for e, expert in enumerate(block.mlp.experts):
                if (i, e) not in chosen:
                    expert.gate_up.weight.data.fill_(float("nan"))
                    expert.down.weight.data.fill_(float("nan"))
    state.length -= 1
    assert torch.equal(lm.step(IDS[:1, 9], state), python) and stacked(lm)


def transformers_state(lm, reference) -> dict:
    """What lm stores (lm.parameters(): dequantized as its arithmetic sees them) in transformers 5's layout, whose
    experts are fused 3-D parameters."""
    names = NAMES[lm.plan.model_type]
    weights, state = lm.parameters(), {}
    for key in reference.state_dict():
        layer = key.split(".")[2] if key.startswith("model.layers.") else None
        block = f"model.layers.{layer}.{names['block']}"
        n = lm.plan.block_options["experts"]["n_experts"]
        if key.endswith("experts.gate_up_proj"):
            state[key] = torch.stack([torch.cat([weights[f"{block}experts.{e}.{names[p]}.weight"] for p in ("gate", "up")])
                                      for e in range(n)])
        elif key.endswith("experts.down_proj"):
            state[key] = torch.stack([weights[f"{block}experts.{e}.{names['down']}.weight"] for e in range(n)])
        elif key.endswith("mlp.gate.weight") and names["block"] != "mlp.":
            state[key] = weights[f"{block}gate.weight"]
        else:
            state[key] = weights[key]
    return {k: v.float() for k, v in state.items()}


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("weight_format, profile, module, tolerance", [
    ("bfloat16", None, MatvecLinear, 1e-4),
    ("int8", None, Int8Linear, 1e-4),
    ("int4", None, Int4Linear, 1e-4),
])
def test_experts_in_every_weight_format_match_transformers_on_the_stored_weights(tiny_checkpoint, name, weight_format,
                                                                                  profile, module, tolerance):
    """Each expert's projections are re-stored like any other; transformers given the weights as stored (its
    routing then the same) gives the same logits, to float32's rounding. (Under bf16 a near tie between experts
    may route otherwise than float32 does: test_bfloat16_matches_transformers_bfloat16 compares bf16 with bf16.)"""
    path, reference = tiny_checkpoint(name)
    lm = CausalLM.load(path, weight_format=weight_format, numeric_profile=profile, device="cpu")
    mixture = next(b.mlp for b in lm.blocks if isinstance(b.mlp, MixtureOfExperts))
    assert all(isinstance(expert.gate_up, module) and isinstance(expert.down, module) for expert in mixture.experts)
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    try:
        reference.load_state_dict(transformers_state(lm, reference))
        with torch.no_grad():
            expected = reference(IDS).logits
    finally:
        reference.load_state_dict(original)
    delta = worst_delta(lm.forward(IDS), expected)
    print(f"{name} {weight_format}/{profile}: worst |delta logit| / scale = {delta:.2e}")
    assert delta <= tolerance


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_bfloat16_matches_transformers_bfloat16(tiny_checkpoint, name):
    import transformers

    path, _ = tiny_checkpoint(name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    lm = CausalLM.load(path, weight_format="bfloat16", numeric_profile="bf16", device="cpu")
    with torch.no_grad():
        expected = reference(IDS).logits.float()
    delta = worst_delta(lm.forward(IDS), expected)
    print(f"{name} bfloat16: worst |delta logit| / scale = {delta:.2e}")
    assert delta <= 2e-2


GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


def write_moe_gguf(path, reference, qtype=Q.F32, per_expert=False) -> dict:
    """A transformers mixture written as llama.cpp's converter writes it: qwen3moe, or Mixtral as architecture llama
    with an expert_count (q/k rows permuted); each layer's experts stacked (experts, out, in) in ffn_*_exps (with
    `per_expert`, as older converters wrote Mixtral: one blk.N.ffn_gate.E tensor an expert), 2-D and 3-D weights in
    `qtype` (the router F32). Returns {transformers name: float32 tensor the file holds}."""
    c = reference.config
    mixtral = c.model_type == "mixtral"
    writer = gguf_writer(path, c, "llama" if mixtral else "qwen3moe")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if not mixtral:
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if c.sliding_window is not None:
        writer.add_sliding_window(c.sliding_window)
    tokens, merges = tiny_vocab(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    held = {}
    for name, tensor in reference.state_dict().items():
        w = tensor.float().numpy()
        if mixtral and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if name.endswith("experts.gate_up_proj"):
            half = w.shape[1] // 2
            parts = {"ffn_gate_exps": w[:, :half], "ffn_up_exps": w[:, half:]}
        elif name.endswith("experts.down_proj"):
            parts = {"ffn_down_exps": w}
        elif name.startswith("model.layers."):
            _, _, i, stem = name.removesuffix(".weight").split(".", 3)
            parts = {GGUF_LAYER[stem]: w}
        else:
            parts = {{"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                      "lm_head": "output"}[name.removesuffix(".weight")]: w}
        stored = []
        for stem, part in parts.items():
            kind = qtype if part.ndim >= 2 and stem != "ffn_gate_inp" else Q.F32
            data = quantize(np.ascontiguousarray(part), kind)
            gguf_name = f"blk.{name.split('.')[2]}.{stem}.weight" if name.startswith("model.layers.") else f"{stem}.weight"
            if per_expert and stem.endswith("_exps"):
                for e in range(data.shape[0]):
                    writer.add_tensor(gguf_name.replace("_exps.", f".{e}."), data[e],
                                      raw_dtype=kind if kind != Q.F32 else None)
            else:
                writer.add_tensor(gguf_name, data, raw_dtype=kind if kind != Q.F32 else None)
            stored.append(torch.from_numpy(np.array(dequantize(data, kind), dtype=np.float32).reshape(part.shape)))
        value = torch.cat(stored, dim=1) if len(stored) == 2 else stored[0]
        if mixtral and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            value = value.reshape(n, -1, 2, value.shape[1]).transpose(1, 2).reshape(value.shape)
        held[name] = value
    finish(writer)
    return held


@pytest.mark.parametrize("name", ["qwen3_moe_norm", "mixtral"])
@pytest.mark.parametrize("qtype, weight_format", [(Q.F32, "float32"), (Q.Q8_0, "gguf"), (Q.Q4_0, "gguf"),
                                                  (Q.Q8_0, "float32")])
def test_gguf_with_stacked_experts_matches_transformers(tiny_checkpoint, tmp_path, name, qtype, weight_format):
    """Each expert read from its share of the stacked tensor, as stored (gguf) or dequantized: transformers given
    the same weights gives the same logits. transformers' own GGUF loader leaves qwen3moe's expert width out of its
    config, so the oracle is the transformers model of the checkpoint, with the weights the file holds."""
    _, reference = tiny_checkpoint(name)
    held = write_moe_gguf(tmp_path / "m.gguf", reference, qtype)
    with GGUFFile(tmp_path / "m.gguf") as source:
        assert source.config["model_type"] == reference.config.model_type
    lm = CausalLM.load(tmp_path / "m.gguf", weight_format=weight_format, device="cpu")
    assert lm.plan.layer_experts == tuple(
        hasattr(layer.mlp, "experts") for layer in reference.model.layers)
    if weight_format == "gguf":
        mixture = next(b.mlp for b in lm.blocks if isinstance(b.mlp, MixtureOfExperts))
        assert all(isinstance(expert.gate_up, GGUFLinear) for expert in mixture.experts)
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    try:
        reference.load_state_dict(held)
        with torch.no_grad():
            expected = reference(IDS).logits
    finally:
        reference.load_state_dict(original)
    delta = worst_delta(lm.forward(IDS), expected)
    print(f"{name} {qtype.name} as {weight_format}: worst |delta logit| / scale = {delta:.2e}")
    assert delta <= 1e-4


@pytest.mark.parametrize("weight_format", ["float32", "gguf"])
def test_a_gguf_with_one_tensor_an_expert_loads_as_the_stacked_one(tiny_checkpoint, tmp_path, weight_format):
    """Mixtral GGUFs of older converters hold blk.N.ffn_gate.E tensors: the same experts, the same logits."""
    _, reference = tiny_checkpoint("mixtral")
    write_moe_gguf(tmp_path / "stacked.gguf", reference, Q.Q8_0)
    write_moe_gguf(tmp_path / "split.gguf", reference, Q.Q8_0, per_expert=True)
    with GGUFFile(tmp_path / "split.gguf") as source:
        assert "blk.0.ffn_gate.3.weight" in source.tensors
    stacked, split = (CausalLM.load(tmp_path / f"{n}.gguf", weight_format=weight_format, device="cpu")
                      for n in ("stacked", "split"))
    assert split.unused_names == []
    assert torch.equal(split.forward(IDS), stacked.forward(IDS))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_qwen3moe_gguf_matches_transformers_gguf_loader(tmp_path, qtype):
    """transformers' own reading of the same qwen3moe file. Its GGUF loader leaves the experts' width out of the
    config (768, the default, is what it builds), so this mixture's experts are 768 wide; every layer a mixture,
    renormalized, as llama.cpp runs qwen3moe."""
    import transformers

    from conftest import _perturb

    torch.manual_seed(23)
    config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True,
                                         max_position_embeddings=128, initializer_range=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _perturb(model)
    write_moe_gguf(tmp_path / "m.gguf", model, qtype)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    with torch.no_grad():
        expected = theirs.eval()(IDS).logits
    for weight_format in ("float32", "gguf"):
        lm = CausalLM.load(tmp_path / "m.gguf", weight_format=weight_format, device="cpu")
        assert worst_delta(lm.forward(IDS), expected) <= 1e-4, weight_format


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_convert_writes_a_mixture_transformers_loads(tiny_checkpoint, tmp_path, name):
    """`lmstack convert` of a GGUF mixture: each expert under its Hugging Face name, Mixtral's class named (not
    llama's), and transformers' logits on the directory equal lmstack's on the file."""
    import transformers

    from lmstack.convert import convert

    _, reference = tiny_checkpoint(name)
    write_moe_gguf(tmp_path / "m.gguf", reference)
    convert(tmp_path / "m.gguf", tmp_path / "hf")
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(converted).__name__ == type(reference).__name__
    with torch.no_grad():
        expected = converted(IDS).logits
    lm = CausalLM.load(tmp_path / "m.gguf", device="cpu")
    assert worst_delta(lm.forward(IDS), expected) <= 1e-4


@pytest.mark.parametrize("shape", [(4, 32), (5000, 1, 32)], ids=["2-D", "5000 experts"])
def test_a_stacked_experts_tensor_of_the_wrong_shape_is_refused_by_name(tmp_path, shape):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros(shape, dtype=np.float32))
    finish(writer)
    with pytest.raises(Exception, match=r"blk\.0\.ffn_gate_exps\.weight.*\(in, out, experts\)"):
        GGUFFile(tmp_path / "m.gguf")


def test_info_shows_the_experts(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_moe")
    out = subprocess.run([sys.executable, "-m", "lmstack", "info", str(path)], capture_output=True, text=True,
                         check=True).stdout
    text = " ".join(out.split())
    for words in ("qwen3_moe (transformer)", "experts: top 2 of 4 (d_ff 32) on 3 of 4 layers",
                  "not renormalized", "qk_norm True"):
        assert words in text, (words, out)
    lm = CausalLM.load(path, device="cpu")
    weights = lm.parameters()
    total = sum(w.numel() for w in weights.values())
    idle = sum(w.numel() for name, w in weights.items() if ".experts." in name) // 2  # 2 of each layer's 4 experts
    assert f"{total / 1e6:.1f}M parameters" in text
    assert f"a token reads {(total - idle) / 1e6:.1f}M of them ({100 * (total - idle) / total:.0f}%)" in text


@pytest.mark.skipif(not kernels.available(), reason="lmstack's CPU kernels do not run here")
@pytest.mark.parametrize("weight_format, profile", [("float32", None), ("int8", None), ("bfloat16", "bf16")])
def test_a_tokens_mixture_output_does_not_depend_on_its_batch_mates(tiny_checkpoint, weight_format, profile):
    """Under formats.row_invariant (the engine's steps) each token's routing and experts give the same bits in a
    batch of 24 tokens as alone: the engine's batch invariance, down to the mixture."""
    lm = CausalLM.load(tiny_checkpoint("mixtral")[0], weight_format=weight_format, numeric_profile=profile,
                       device="cpu")
    mixture = lm.blocks[0].mlp
    x = torch.randn(1, 24, lm.d_model, generator=torch.Generator().manual_seed(4)).to(lm.dtype)
    with torch.no_grad(), row_invariant():
        together = mixture(x)
        alone = torch.cat([mixture(x[:, i:i + 1]) for i in range(x.shape[1])], dim=1)
    assert torch.equal(together, alone)


@pytest.mark.skipif(not kernels.available(), reason="lmstack's CPU kernels do not run here")
def test_prompt_lookup_gives_a_mixtures_plain_tokens(tiny_checkpoint):
    """Drafts checked in one forward route each token as its own step would: the same tokens as plain decoding."""
    lm = CausalLM.load(tiny_checkpoint("qwen3_moe")[0], device="cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
    assert torch.equal(lm.generate(ids, 24, prompt_lookup=4), lm.generate(ids, 24))


@pytest.mark.skipif(not kernels.available(), reason="the fused block needs the kernels")
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_a_gguf_mixtures_fused_decode_is_bit_equal_to_the_python(tiny_checkpoint, tmp_path, monkeypatch, qtype):
    """Every layer of a mixture, its dense ones and its experts' (test_fused_layer.py checks the other formats),
    in one fused call per step, bit for bit the blocks' Python; qwen3_moe's layer 2 is dense."""
    from test_fused_layer import decode_logits, fused_layers

    write_moe_gguf(tmp_path / "m.gguf", tiny_checkpoint("qwen3_moe")[1], qtype)
    lm = CausalLM.load(tmp_path / "m.gguf", weight_format="gguf", numeric_profile="bf16", device="cpu")
    got = [decode_logits(lm, rows) for rows in (1, 2)]  # (one row takes the mixture's own path)
    assert fused_layers(lm) == len(lm.blocks) and stacked(lm)
    monkeypatch.setattr(TransformerBlock, "fusable", lambda self, x, ctx: False)
    assert all(torch.equal(g, decode_logits(lm, rows)) for g, rows in zip(got, (1, 2)))
