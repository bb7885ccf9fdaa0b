"""Sliding-window perplexity against transformers' own loss, and the quality cost of each weight format."""

import math

import pytest
import torch

from lmstack import CausalLM
from lmstack.perplexity import perplexity

FIXTURES = __import__("conftest").FIXTURES


def transformers_perplexity(model, ids, window, stride):
    """The loop of transformers' perplexity guide, with the model's own shifted cross-entropy loss."""
    nll, count, end_before = 0.0, 0, 0
    for start in range(0, ids.shape[1], stride):
        end = min(start + window, ids.shape[1])
        target_len = end - end_before
        chunk = ids[:, start:end]
        labels = chunk.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = model(chunk, labels=labels).loss
        scored = int((labels[:, 1:] != -100).sum())
        nll += float(loss) * scored
        count += scored
        end_before = end
        if end == ids.shape[1]:
            break
    return math.exp(nll / count), count


@pytest.mark.parametrize("window, stride", [(32, 16), (32, 32), (48, 20), (200, 100)])
def test_matches_transformers_sliding_window(tiny_checkpoint, window, stride):
    path, reference = tiny_checkpoint("llama")
    lm = CausalLM.load(path, device="cpu")
    ids = torch.randint(0, lm.vocab_size, (1, 101), generator=torch.Generator().manual_seed(0))
    expected, count = transformers_perplexity(reference, ids, window, min(stride, window))
    result = perplexity(lm, ids, window=window, stride=stride)
    assert result.tokens == count
    assert count == (100 if stride < window else 100 - (101 - 1) // window)  # no overlap: window starts unscored
    assert result.perplexity == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kwargs, words", [
    (dict(window=0), "window"),
    (dict(window=8, stride=9), "stride 9"),
    (dict(window=4096), "max_positions"),
])
def test_bad_windows_are_refused(tiny_checkpoint, kwargs, words):
    lm = CausalLM.load(tiny_checkpoint("llama")[0], device="cpu")
    with pytest.raises(ValueError, match=words):
        perplexity(lm, [list(range(200))], **kwargs)


@pytest.mark.parametrize("weight_format, limit", [("bfloat16", 0.01), ("int8", 0.02), ("int4", 0.25)])
def test_weight_format_quality_on_real_text(smollm2_hf, weight_format, limit):
    """SmolLM2 on a real English text (the Apache licence shipped with the fixtures)."""
    from lmstack import Tokenizer

    text = (FIXTURES / "tokenizers" / "smollm2" / "LICENSE").read_text()
    ids = Tokenizer.from_pretrained(smollm2_hf).encode(text, add_special_tokens=False)[:768]
    base = perplexity(CausalLM.load(smollm2_hf, device="cpu"), [ids], window=256, stride=128)
    other = perplexity(CausalLM.load(smollm2_hf, weight_format=weight_format, device="cpu"), [ids],
                       window=256, stride=128)
    change = other.perplexity / base.perplexity - 1
    print(f"perplexity float32 {base.perplexity:.3f}, {weight_format} {other.perplexity:.3f} ({change:+.2%})")
    assert abs(change) < limit
