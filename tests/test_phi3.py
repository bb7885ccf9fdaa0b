"""Phi-3 / Phi-4-mini beyond the parity tests (test_parity.py runs the phi3 and phi4_mini VARIANTS, whose sequences
stay within the original context): LongRoPE's long factors past it, the plan's readings and refusals, partial
rotary on the Python path, and a paged engine serving Phi-4-mini."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from conftest import BASE, _perturb
from test_gguf import finish, gguf_writer
from lmstack import CausalLM, ConfigError, UnsupportedModel, plan_for
from lmstack.engine import Engine

PHI3 = dict(model_type="phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=256, max_position_embeddings=128, original_max_position_embeddings=8,
            rope_scaling=dict(type="su", short_factor=[1.0] * 8, long_factor=[2.0] * 8))


@pytest.fixture(scope="module")
def crossing(tmp_path_factory):
    """A Phi-3 whose original context (8) the tests cross; its transformers reference in float32."""
    path = tmp_path_factory.mktemp("phi3") / "m"
    torch.manual_seed(3)
    config = transformers.Phi3Config(**{**BASE, "num_key_value_heads": 2, "original_max_position_embeddings": 8,
                                        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                        "rope_parameters": dict(rope_type="longrope", rope_theta=10000.0,
                                                                short_factor=[1.0 + 0.1 * i for i in range(8)],
                                                                long_factor=[4.0 + i for i in range(8)])})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _perturb(model)
    model.save_pretrained(path)
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_long_factors_past_the_original_context_match_transformers(crossing):
    path, reference = crossing
    lm = CausalLM.load(path, device="cpu")
    for length in (8, 17):  # within the original context, then past it (every position takes the long factors)
        ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = reference(ids).logits
        torch.testing.assert_close(lm.forward(ids), expected, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_across_the_switch_match_transformers(crossing):
    """The prompt within the original context, the steps past it: each forward chooses its factors, as the
    reference's does, and the cached keys keep theirs."""
    path, reference = crossing
    lm = CausalLM.load(path, device="cpu")
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(2))
    reference.generation_config.eos_token_id = None
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                  pad_token_id=0)
    assert torch.equal(lm.generate(ids, 16), expected)


def test_plan_reads_phi3_configs():
    plan = plan_for(PHI3)  # the legacy "su" type is LongRoPE, as transformers reads it
    rope = plan.block_options["rope"]
    assert rope["type"] == "longrope" and rope["factor"] == 16.0 and rope["original_max_position_embeddings"] == 8
    names = [name for _, name, rows in plan.layer_weights(0)]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert all(rows is None for _, _, rows in plan.layer_weights(0))  # each fills its fused matrix whole
    mini = plan_for({**PHI3, "partial_rotary_factor": 0.75, "rope_scaling": None})
    assert mini.block_options["rotary_dim"] == 12


@pytest.mark.parametrize("changes, error, words", [
    (dict(model_type="llama", rope_scaling=None, partial_rotary_factor=0.5), UnsupportedModel, "partial_rotary"),
    (dict(model_type="llama", rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 8)),
     UnsupportedModel, "longrope"),
    (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 7, long_factor=[1.0] * 8)), ConfigError,
     "short_factor"),
    (dict(rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor=[0.0] * 8)), ConfigError,
     "long_factor"),
    (dict(partial_rotary_factor=0.1), ConfigError, "partial_rotary_factor"),  # 1.6 of 16 values: odd
    (dict(final_logit_softcapping=30.0), UnsupportedModel, "final_logit_softcapping"),
])
def test_refusals_name_the_field(changes, error, words):
    with pytest.raises(error, match=words):
        plan_for({**PHI3, **changes})


def test_partial_rotary_runs_the_python_path(tiny_checkpoint):
    """The kernels rotate whole heads: a partial-rotary block says so and never takes the fused step."""
    lm = CausalLM.load(tiny_checkpoint("phi4_mini")[0], device="cpu")
    assert all(block.fused_options() == ["rotary_dim"] and block.fused_layer(torch.float32) is None
               for block in lm.blocks)


def test_engine_serves_phi4_mini_batch_invariantly(tiny_checkpoint):
    """16 requests together give the tokens each gives alone (partial rotary and LongRoPE in the paged path)."""
    lm = CausalLM.load(tiny_checkpoint("phi4_mini")[0], device="cpu")
    g = torch.Generator().manual_seed(5)
    cases = [(torch.randint(0, 256, (int(n),), generator=g).tolist(), dict(max_tokens=10, eos_ids=(), **(
        dict(temperature=0.9, top_k=50, seed=i) if i % 2 else {}))) for i, n in
        enumerate(torch.randint(1, 30, (16,), generator=g))]

    def engine():
        return Engine(lm, kv_cache_memory=64 * lm.page_bytes(16), max_prefill_tokens=24)

    with engine() as e:
        together = [list(h) for h in [e.add(p, **r) for p, r in cases]]
    alone = []
    for p, r in cases:
        with engine() as e:
            alone.append(list(e.add(p, **r)))
    assert together == alone
    assert together[0] == lm.generate(torch.tensor([cases[0][0]]), 10)[0, len(cases[0][0]):].tolist()


def write_phi3_gguf(path, reference):
    """As llama.cpp's convert_hf_to_gguf.py writes Phi-3: qkv_proj as attn_qkv, gate_up_proj as ffn_up, LongRoPE's
    factors as the tensors rope_factors_short/long, the rotated part of a head as rope.dimension_count."""
    c = reference.config
    rope = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads
    writer = gguf_writer(path, c, "phi3")
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_uint32("phi3.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    factor = c.max_position_embeddings / rope["original_max_position_embeddings"]
    writer.add_float32("phi3.rope.scaling.attn_factor",
                       math.sqrt(1 + math.log(factor) / math.log(rope["original_max_position_embeddings"])))
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<{i}>" for i in range(c.vocab_size)])
    writer.add_token_scores([0.0] * c.vocab_size)
    writer.add_token_types([1] * c.vocab_size)
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    layer = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        stem = name.removesuffix(".weight")
        if stem in top:
            gguf_name = top[stem]
        else:
            _, _, i, rest = stem.split(".", 3)
            gguf_name = f"blk.{i}.{layer[rest]}"
        writer.add_tensor(gguf_name + ".weight", tensor.float().numpy())
    finish(writer)


@pytest.mark.parametrize("which", ["crossing", "phi4_mini"])
def test_gguf_logits_match_transformers(request, tiny_checkpoint, tmp_path, which):
    """Fused tensors misnamed, factors misread, the attention factor or the rotated width wrong: these change."""
    path, reference = request.getfixturevalue("crossing") if which == "crossing" else tiny_checkpoint("phi4_mini")
    write_phi3_gguf(tmp_path / "m.gguf", reference)
    lm = CausalLM.load(tmp_path / "m.gguf", device="cpu")
    assert lm.plan.block_options["rope"]["type"] == "longrope"
    for length in (5, 17):  # within and past the crossing model's original context
        ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = reference(ids).logits
        torch.testing.assert_close(lm.forward(ids), expected, rtol=1e-4, atol=1e-4)


def test_info_shows_phi_options(tiny_checkpoint):
    path, _ = tiny_checkpoint("phi4_mini")
    out = subprocess.run([sys.executable, "-m", "lmstack", "info", str(path)], capture_output=True, text=True,
                         check=True).stdout
    text = " ".join(out.split())
    for words in ("phi3 (transformer)", "rope type=longrope", "short_factor=[6 values]", "rotary dims 12 of 16",
                  "tied embeddings True"):
        assert words in text, (words, out)


def test_engine_refuses_a_request_past_the_original_context(crossing):
    """KV pages keep the keys the short factors rotated: a request that would pass the original context (8) is
    refused by name when added, before it can end the requests beside it."""
    lm = CausalLM.load(crossing[0], device="cpu")
    with Engine(lm, kv_cache_memory=16 * lm.page_bytes(16)) as engine:
        with pytest.raises(ValueError, match="LongRoPE's original context"):
            engine.add(list(range(5)), max_tokens=4)
        assert len(list(engine.add(list(range(5)), max_tokens=3))) == 3
