"""lmstack against transformers on tiny random checkpoints of every family and variant."""

import pytest
import torch
import transformers

from conftest import VARIANTS
from lmstack import CausalLM, kernels

SEQ = 17  # longer than every sliding window in VARIANTS


def worst_delta(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |delta logit| relative to the logit scale (at least 1)."""
    return float((out - ref).abs().max() / max(1.0, float(ref.abs().max())))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_float32_logits_match_transformers(tiny_checkpoint, name):
    path, reference = tiny_checkpoint(name)
    lm = CausalLM.load(path, device="cpu")
    ids = torch.randint(0, lm.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
    delta = worst_delta(lm.forward(ids), expected)
    print(f"{name}: worst |delta logit| / scale = {delta:.2e}")
    assert delta <= 1e-4


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prefill_then_steps_equal_stateless_forward(tiny_checkpoint, name):
    path, _ = tiny_checkpoint(name)
    lm = CausalLM.load(path, device="cpu")
    ids = torch.randint(0, lm.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(1))
    full = lm.forward(ids)
    state = lm.allocate_state(3, SEQ)
    prefix = 6
    pieces = [lm.forward(ids[:, :prefix], state)]
    pieces += [lm.step(ids[:, i], state)[:, None] for i in range(prefix, SEQ)]
    assert state.length == SEQ
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_generate_matches_transformers(tiny_checkpoint, name):
    path, reference = tiny_checkpoint(name)
    lm = CausalLM.load(path, device="cpu")
    ids = torch.randint(0, lm.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    reference.generation_config.eos_token_id = None  # run all 32 tokens; suppressing EOS would bias it
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                  do_sample=False, pad_token_id=0)
    assert expected.shape[1] == ids.shape[1] + 32
    assert torch.equal(lm.generate(ids, 32), expected)


@pytest.mark.parametrize("name", ["llama", "llama_bf16", "qwen3", "mistral_window", "gemma2", "gemma3_text",
                                  "phi4_mini"])
def test_bfloat16_matches_transformers_bfloat16(tiny_checkpoint, name):
    path, _ = tiny_checkpoint(name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    lm = CausalLM.load(path, weight_format="bfloat16", numeric_profile="bf16", device="cpu")
    ids = torch.randint(0, lm.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids).logits.float()
    delta = worst_delta(lm.forward(ids), expected)
    print(f"{name} bfloat16: worst |delta logit| / scale = {delta:.2e}")
    assert delta <= 2e-2


@pytest.mark.parametrize("profile", [None, "bf16"])
@pytest.mark.parametrize("kernels_on", [True, False])
def test_bfloat16_load_keeps_checkpoint_bits(tiny_checkpoint, profile, kernels_on, monkeypatch):
    """Projections keep their bits; so do the embedding and head where lmstack's kernels multiply bfloat16 in
    float32 (the values are the same in either dtype); the norms take the arithmetic's dtype (exactly)."""
    from safetensors.torch import load_file

    if not kernels_on:
        monkeypatch.setattr(kernels, "available", lambda: False)
    path, _ = tiny_checkpoint("llama_bf16")
    lm = CausalLM.load(path, weight_format="bfloat16", numeric_profile=profile, device="cpu")
    saved = load_file(path / "model.safetensors")
    weights = lm.parameters()
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16
        held = weights[name]
        kept = profile or name.endswith("proj.weight") or \
            name in ("model.embed_tokens.weight", "lm_head.weight") and kernels.available()
        assert held.dtype == (torch.bfloat16 if kept else torch.float32), name
        assert torch.equal(held.bfloat16().view(torch.int16), tensor.view(torch.int16)), name


def test_sharded_checkpoint_reads_every_shard(tiny_checkpoint):
    path, _ = tiny_checkpoint("llama_sharded")
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1, shards
    lm = CausalLM.load(path, device="cpu")
    assert lm.unused_names == []
