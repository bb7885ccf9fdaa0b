"""GGUF files the tests write with gguf.GGUFWriter, as llama.cpp's converter writes them, read back by lmstack."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from quantize import quantize  # gguf's, and the K types gguf cannot quantize

from lmstack import CausalLM, Tokenizer, UnsupportedModel
from lmstack.families.transformer import GGUF_LAYER_NAMES, GGUF_NAMES
from lmstack.gguf import GGUFFile, is_gguf

HF_TO_GGUF = {**{v: k for k, v in GGUF_NAMES.items()}, **{v: k for k, v in GGUF_LAYER_NAMES.items()}}
QUANT_ERROR = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.2}  # max |error| / max |weight|, per tensor


def gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        return f"blk.{i}.{HF_TO_GGUF[rest]}.{suffix}"
    return f"{HF_TO_GGUF[stem]}.{suffix}"


def permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def tiny_vocab(size: int) -> tuple[list[str], list[str]]:
    """A byte-level vocabulary as GGUF spells it: printable ASCII ("Ġ" for space), letter pairs, <s>, </s>."""
    singles = ["Ġ"] + [chr(c) for c in range(33, 127)]
    pairs = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]
    pairs = pairs[:size - 2 - len(singles)]
    return singles + pairs + ["<s>", "</s>"], [f"{p[0]} {p[1]}" for p in pairs]


def gguf_writer(path, config, arch: str) -> gguf.GGUFWriter:
    """A GGUFWriter for `arch` holding the sizes every architecture's metadata gives, from a transformers config."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    return writer


def finish(writer: gguf.GGUFWriter):
    """Write the header, the metadata and the tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(path, reference, arch="llama", qtype=Q.F32, tensor_types=None):
    """Write a transformers model as llama.cpp would: 2-D weights in `qtype`, norms in F32, q/k permuted for llama.

    Returns {Hugging Face name: the float32 tensor the file holds, in HF layout}.
    """
    c = reference.config
    writer = gguf_writer(path, c, arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim != c.hidden_size // c.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens, merges = tiny_vocab(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (c.vocab_size - 2) + [3, 3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(c.vocab_size - 2)
    writer.add_eos_token_id(c.vocab_size - 1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    held = {}
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        kind = (tensor_types or {}).get(name, qtype if w.ndim == 2 else Q.F32)
        data = w.astype(np.int8) if kind == Q.I8 else quantize(w, kind)
        writer.add_tensor(gguf_name(name), data, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        held[name] = tensor.float()
        if kind in QUANT_ERROR:
            stored = torch.from_numpy(np.array(dequantize(data, kind), dtype=np.float32).reshape(w.shape))
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                n = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
                stored = stored.reshape(n, -1, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
            held[name] = stored
    finish(writer)
    return held


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_weights_equal_originals_within_quantization_error(tiny_checkpoint, tmp_path, qtype):
    _, reference = tiny_checkpoint("llama_tied_gqa")
    held = write_gguf(tmp_path / "m.gguf", reference, qtype=qtype)
    lm = CausalLM.load(tmp_path / "m.gguf", device="cpu")
    weights = lm.parameters()
    originals = {k: v.detach().float() for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    assert set(weights) == set(originals) and lm.unused_names == []
    for name, original in originals.items():
        # exactly what the file holds (q/k rows back in HF order), and that is the original up to quantization
        torch.testing.assert_close(weights[name], held[name], rtol=0, atol=0, msg=name)
        error = float((weights[name].detach() - original).abs().max() / original.abs().max())
        assert error <= QUANT_ERROR[qtype if original.dim() == 2 else Q.F32] + 1e-7, (name, error)


@pytest.mark.parametrize("name,arch", [("llama", "llama"), ("llama_tied_gqa", "llama"), ("qwen3", "qwen3")])
def test_f32_gguf_logits_match_transformers(tiny_checkpoint, tmp_path, name, arch):
    """A wrong un-permutation of q/k, a wrong head_dim or a missed q/k norm changes these logits."""
    _, reference = tiny_checkpoint(name)
    write_gguf(tmp_path / "m.gguf", reference, arch=arch)
    lm = CausalLM.load(tmp_path / "m.gguf", device="cpu")
    ids = torch.randint(0, lm.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(lm.forward(ids), expected, rtol=1e-4, atol=1e-4)
    assert lm.eos_ids == (lm.vocab_size - 1,)


def test_config_from_metadata(tiny_checkpoint, tmp_path):
    _, reference = tiny_checkpoint("qwen3")
    write_gguf(tmp_path / "m.gguf", reference, arch="qwen3")
    with GGUFFile(tmp_path / "m.gguf") as source:
        c = reference.config
        assert source.config["model_type"] == "qwen3"
        assert source.config["head_dim"] == c.head_dim == 24
        assert (source.config["num_attention_heads"], source.config["num_key_value_heads"]) == (4, 2)
        assert source.config["tie_word_embeddings"] is False


def test_tokenizer_from_metadata(tiny_checkpoint, tmp_path):
    _, reference = tiny_checkpoint("llama")
    write_gguf(tmp_path / "m.gguf", reference)
    tok = Tokenizer.from_pretrained(tmp_path / "m.gguf")
    ab, ac = 95 + 1, 95 + 2  # after the 95 single characters: "aa", "ab", "ac", ...
    assert tok.encode("ab ac!", add_special_tokens=False) == [ab, 0, ac, 1]
    assert tok.decode([ab, 0, ac, 1]) == "ab ac!"
    assert (tok.bos_ids, tok.eos_ids) == ((254,), (255,))
    assert tok.encode("ab</s>", add_special_tokens=False, allow_special=True) == [ab, 255]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_unknown_architecture_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(UnsupportedModel, match="architecture 'falcon'"):
        CausalLM.load(tmp_path / "m.gguf", device="cpu")


def test_tensor_type_gguf_cannot_dequantize_is_refused_by_name(tiny_checkpoint, tmp_path):
    _, reference = tiny_checkpoint("llama")
    bad = "model.layers.0.mlp.up_proj.weight"
    write_gguf(tmp_path / "m.gguf", reference, tensor_types={bad: Q.I8})
    with pytest.raises(UnsupportedModel, match=r"'blk\.0\.ffn_up\.weight' has type I8"):
        CausalLM.load(tmp_path / "m.gguf", device="cpu")


def test_gguf_is_recognized_by_its_magic_not_its_name(tiny_checkpoint, tmp_path):
    _, reference = tiny_checkpoint("llama")
    write_gguf(tmp_path / "weights.bin", reference)
    assert is_gguf(tmp_path / "weights.bin") and not is_gguf(tmp_path)
    assert CausalLM.load(tmp_path / "weights.bin", device="cpu").plan.family == "llama"
