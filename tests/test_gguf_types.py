"""GGUF files as people publish them (Q2_K to Q8_0, and Q4_K_M's mix) against transformers' own GGUF loader.

transformers dequantizes every tensor to float32 with `gguf`; under float32 arithmetic lmstack must hold the
very same weights and give the same logits and greedy tokens. The tiny model's rows are 256 long (a K type's
block) except ffn_down's 320, which takes llama.cpp's fallback type, as SmolLM2's 576 does.
"""

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from quantize import FALLBACK
from test_gguf import write_gguf

from lmstack import CausalLM, model
from lmstack import gguf as gguf_module

TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K, Q.Q5_0, Q.Q5_1, Q.Q8_0]


def tiny_llama(tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, initializer_range=0.05)
    torch.manual_seed(22 + tied)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tensor_types(model, choose) -> dict:
    """{name: type} for the 2-D weights: choose(name), or its fallback where the row length is not 256's multiple."""
    types = {}
    for name, tensor in model.state_dict().items():
        if tensor.dim() == 2:
            qtype = choose(name)
            types[name] = FALLBACK.get(qtype, qtype) if tensor.shape[1] % 256 else qtype
    return types


def q4_k_m(name: str) -> Q:
    """llama.cpp's Q4_K_M choice in small: Q6_K for the (tied) embedding, the first layer's attn_v and
    ffn_down, Q4_K elsewhere."""
    if name == "model.embed_tokens.weight" or name.startswith("model.layers.0.") and "v_proj" in name:
        return Q.Q6_K
    return Q.Q6_K if name.startswith("model.layers.0.") and "down_proj" in name else Q.Q4_K


CASES = {qtype.name: (False, lambda name, qtype=qtype: qtype) for qtype in TYPES}
CASES["Q4_K_M"] = (True, q4_k_m)


def load_both(case: str, path, weight_format: str = "gguf"):
    """The case's GGUF written to path/m.gguf; (transformers' model of it, lmstack's, the tensor types)."""
    tied, choose = CASES[case]
    model = tiny_llama(tied)
    types = tensor_types(model, choose)
    write_gguf(path / "m.gguf", model, tensor_types=types)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, gguf_file="m.gguf", dtype=torch.float32)
    lm = CausalLM.load(path / "m.gguf", weight_format=weight_format, numeric_profile="fp32", device="cpu")
    return reference.eval(), lm, types


def assert_same_weights_and_logits(reference, lm, types):
    tied = reference.config.tie_word_embeddings
    expected = {k: v for k, v in reference.state_dict().items() if not (tied and k == "lm_head.weight")}
    weights = lm.parameters()
    assert set(weights) == set(expected)
    for name, weight in weights.items():  # dequantized bit for bit, q/k rows in Hugging Face's order
        assert np.array_equal(weight.detach().numpy().view(np.uint32), expected[name].numpy().view(np.uint32)), \
            (name, types.get(name))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = reference(ids).logits
    torch.testing.assert_close(lm.forward(ids), logits, rtol=1e-4, atol=1e-4)
    return ids


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_equal_transformers_gguf_loader(case, tmp_path):
    reference, lm, types = load_both(case, tmp_path)
    ids = assert_same_weights_and_logits(reference, lm, types)
    reference.generation_config.eos_token_id = None  # all 16 tokens
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                  pad_token_id=0)
    assert torch.equal(lm.generate(ids, 16), expected)


@pytest.mark.parametrize("case,weight_format", [("Q8_0", "gguf"), ("Q4_K_M", "gguf"), ("Q4_K_M", "float32")])
def test_tensors_read_a_few_rows_at_a_time_are_the_same(case, weight_format, tmp_path, monkeypatch):
    """Loading reads and packs (or dequantizes) a tensor a chunk of rows at a time, so that no second copy of a
    whole tensor is held: chunks small enough to cut q from k, and gate from up, give the same weights."""
    monkeypatch.setattr(model, "PACK_CHUNK_BYTES", 24 * 272)  # 24 rows of 256 Q8_0 values, 40 of Q4_K
    monkeypatch.setattr(gguf_module, "CHUNK_BYTES", 4096)  # 4 rows of 256 float32 values
    reference, lm, types = load_both(case, tmp_path, weight_format)
    assert_same_weights_and_logits(reference, lm, types)
