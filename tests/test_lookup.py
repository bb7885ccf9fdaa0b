"""Prompt lookup decoding (lookup.py): the checking forward gives each position bit for bit the logits of a
one-token step, so the tokens are the plain generation's; what cannot be checked exactly is refused by name.

The oracle is lmstack's own plain decoding (one step per token), run beside it in the same test.
"""

import gguf
import pytest
import torch
import transformers

from lmstack import CausalLM, PromptLookupError, Tokenizer, kernels
from lmstack.formats import row_invariant
from lmstack.lookup import NgramIndex
from lmstack.models import smollm2
from test_cli import lmstack

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the exact multi-token check needs the kernels")
FAMILIES = ["llama", "llama_tied_gqa", "llama_bias", "mistral_window", "qwen2_sliding", "qwen3", "qwen3_bias_sliding"]
TEXT = ("The quick brown fox jumsp over the lazy dog. Every mornign, the fox runs trough the forest, looking for food "
        "and avoiding the hunters who live in the vilage nearby. In the evening it returns to its den.")


def random_ids(n, seed):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def steps(lm, prompt, fed):
    """The logits after each token of fed, as plain decoding computes them: a prefill, then one step per token."""
    state = lm.allocate_state(1, 64)
    lm._run(prompt, state, last_only=True)
    return torch.stack([lm._run(fed[:, i:i + 1], state, last_only=True)[0, -1] for i in range(fed.shape[1])])


def checked(lm, prompt, fed, state=None):
    """The logits after each token of fed from one checking forward (and the state it leaves)."""
    if state is None:
        state = lm.allocate_state(1, 64)
        lm._run(prompt, state, last_only=True)
    with row_invariant():
        return lm._run(fed, state, alone=True)[0], state


@needs_kernels
@pytest.mark.parametrize("weight_format, profile", [("float32", None), ("bfloat16", "bf16")])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_checking_forward_gives_each_position_the_logits_of_its_step(tiny_checkpoint, name, weight_format, profile):
    lm = CausalLM.load(tiny_checkpoint(name)[0], weight_format=weight_format, numeric_profile=profile, device="cpu")
    prompt, fed = random_ids(3, 0), random_ids(11, 1)  # past every sliding window (4 to 6) within the forward
    got, _ = checked(lm, prompt, fed)
    assert got.dtype == lm.dtype and torch.equal(got, steps(lm, prompt, fed))


@needs_kernels
@pytest.mark.parametrize("weight_format, profile", [("int8", None), ("int8", "bf16"), ("int4", None), ("int4", "bf16"),
                                                    ("bfloat16", None)])
@pytest.mark.parametrize("name", ["llama_tied_gqa", "qwen3"])
def test_every_row_invariant_format_checks_exactly(tiny_checkpoint, name, weight_format, profile):
    lm = CausalLM.load(tiny_checkpoint(name)[0], weight_format=weight_format, numeric_profile=profile, device="cpu")
    prompt, fed = random_ids(5, 2), random_ids(16, 3)
    assert torch.equal(checked(lm, prompt, fed)[0], steps(lm, prompt, fed))


@needs_kernels
@pytest.mark.parametrize("profile", [None, "bf16"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_as_stored_check_exactly(tiny_checkpoint, tmp_path, qtype, profile):
    from test_gguf import write_gguf

    write_gguf(tmp_path / "m.gguf", tiny_checkpoint("llama_tied_gqa")[1], qtype=gguf.GGMLQuantizationType[qtype])
    lm = CausalLM.load(tmp_path / "m.gguf", weight_format="gguf", numeric_profile=profile, device="cpu")
    prompt, fed = random_ids(5, 2), random_ids(16, 3)
    assert torch.equal(checked(lm, prompt, fed)[0], steps(lm, prompt, fed))


@needs_kernels
@pytest.mark.parametrize("name", ["llama_tied_gqa", "mistral_window"])
def test_drafts_cut_back_leave_the_cache_as_if_never_run(tiny_checkpoint, name):
    lm = CausalLM.load(tiny_checkpoint(name)[0], weight_format="bfloat16", numeric_profile="bf16", device="cpu")
    prompt, fed, then = random_ids(6, 4), random_ids(7, 5), random_ids(4, 6)
    _, state = checked(lm, prompt, fed)
    state.length -= 5  # two kept
    got, _ = checked(lm, prompt, then, state)
    assert torch.equal(got, steps(lm, prompt, torch.cat([fed[:, :2], then], 1))[2:])


def test_drafts_follow_the_first_earlier_occurrence_of_the_longest_ngram():
    index = NgramIndex(3, [5, 6, 7, 8, 9, 6, 7, 1, 2, 7])
    assert index.draft(3) == [8, 9, 6]  # (7,) first ended at 3; (2, 7) and (1, 2, 7) had not occurred
    index.append(1)
    assert index.draft(5) == [2, 7, 1]  # (7, 1) first ended at 8; what follows runs to the end
    index.append(3)
    assert index.draft(4) == []


def counting(lm, monkeypatch):
    """lm with its forwards counted."""
    calls = []
    run = lm._run
    monkeypatch.setattr(lm, "_run", lambda *a, **k: calls.append(1) or run(*a, **k))
    return calls


@needs_kernels
@pytest.mark.parametrize("name", ["llama_tied_gqa", "mistral_window", "qwen3_bias_sliding"])
@pytest.mark.parametrize("sampling", [{}, dict(repetition_penalty=1.3),
                                      dict(greedy=False, temperature=0.7, top_k=20, top_p=0.9, seed=3)])
def test_generation_equals_the_plain_one(tiny_checkpoint, name, sampling, monkeypatch):
    lm = CausalLM.load(tiny_checkpoint(name)[0], weight_format="bfloat16", numeric_profile="bf16", device="cpu")
    prompt = random_ids(10, 0).repeat(1, 3)
    plain = lm.generate(prompt, 40, **sampling)
    calls = counting(lm, monkeypatch)
    assert torch.equal(lm.generate(prompt, 40, prompt_lookup=6, **sampling), plain)
    if name == "llama_tied_gqa":  # it falls into loops, greedy or sampled: drafts are kept, forwards saved
        assert len(calls) < 36


@needs_kernels
def test_stopping_inside_a_draft_stops_where_the_plain_generation_stops(tiny_checkpoint):
    lm = CausalLM.load(tiny_checkpoint("llama_tied_gqa")[0], device="cpu")
    prompt = random_ids(10, 8).repeat(1, 3)
    plain = lm.generate(prompt, 40)[0, 30:].tolist()
    eos = plain[17]
    expected = plain[:plain.index(eos) + 1]
    assert [int(t) for t in lm.stream(prompt, 40, eos_ids=[eos], prompt_lookup=8)] == expected
    until = lambda tokens: tokens == plain[11]  # noqa: E731
    expected = plain[:plain.index(plain[11]) + 1]
    assert [int(t) for t in lm.stream(prompt, 40, until=until, prompt_lookup=8)] == expected


@needs_kernels
@pytest.mark.parametrize("weight_format, profile", [("gguf", "bf16"), ("float32", None)])
def test_the_real_model_repeats_a_text_with_the_plain_greedy_tokens(weight_format, profile):
    path = smollm2()
    lm, tok = CausalLM.load(path, weight_format=weight_format, numeric_profile=profile, device="cpu"), \
        Tokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": TEXT + "\n\nRepeat the text above, fixing the typos."}]
    prompt = tok.encode(tok.apply_chat_template(messages))
    plain = lm.generate([prompt], 48, eos_ids=lm.eos_ids)
    assert torch.equal(lm.generate([prompt], 48, eos_ids=lm.eos_ids, prompt_lookup=10), plain)


def test_what_cannot_be_checked_exactly_is_refused_by_name(tiny_checkpoint, tmp_path, monkeypatch):
    lm = CausalLM.load(tiny_checkpoint("llama")[0], weight_format="bfloat16", numeric_profile="bf16", device="cpu")
    with pytest.raises(PromptLookupError, match="one prompt at a time, got a batch of 2"):
        lm.generate([[1, 2], [3, 4]], 4, prompt_lookup=4)
    for name, value in (("prompt_lookup", -1), ("prompt_lookup", True), ("lookup_ngram", 0), ("lookup_ngram", 1.5)):
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            lm.stream([[1, 2]], 4, **{"prompt_lookup": 4, name: value})
    monkeypatch.setattr(type(lm.head_projection), "row_invariant", False)
    with pytest.raises(PromptLookupError, match="weight_format 'bfloat16' in profile 'bf16' multiplies with"):
        lm.generate([[1, 2]], 4, prompt_lookup=4)
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(PromptLookupError, match="needs lmstack's CPU kernels"):
        lm.generate([[1, 2]], 4, prompt_lookup=4)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    mamba = CausalLM.load(tmp_path, device="cpu")
    with pytest.raises(PromptLookupError, match="mamba1 model's multi-token scan is not its one-token step"):
        mamba.stream([[1, 2]], 4, prompt_lookup=4)
    assert mamba.generate([[1, 2]], 4, prompt_lookup=0).shape == (1, 6)


@needs_kernels
def test_the_command_prints_the_plain_text(tiny_checkpoint, tmp_path):
    from test_gguf import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_checkpoint("llama_tied_gqa")[1])
    common = ("generate", "abcabcabcabc", "--model", str(path), "-n", "24", "--weight-format", "bfloat16")
    plain = lmstack(*common)
    assert plain[0] == 0 and lmstack(*common, "--prompt-lookup", "6", "--lookup-ngram", "2") == plain
    code, _, err = lmstack(*common, "--prompt-lookup", "-1")
    assert code == 2 and "--prompt-lookup" in err
