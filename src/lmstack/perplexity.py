"""Sliding-window perplexity: the quality cost of a weight format as one number."""

import math
from dataclasses import dataclass

import torch

from .model import CausalLM, as_ids


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # tokens scored (all but the first)


def perplexity(lm: CausalLM, ids, *, window: int = 512, stride: int | None = None, progress=None) -> Perplexity:
    """Perplexity of one token sequence, computed as transformers' perplexity guide computes it.

    Windows of `window` tokens start every `stride` tokens (default window // 2); each scores the tokens
    no earlier window reached, with the rest of the window as their context. With stride < window every
    token after the first is scored once; with stride == window the windows do not overlap and the first
    token of each window goes unscored, as in the guide. `progress(done, total)` is called per window.
    """
    ids = as_ids(ids)
    if ids.shape[0] != 1:
        raise ValueError(f"perplexity takes one sequence, got {ids.shape[0]} rows")
    stride = window // 2 if stride is None else stride
    for name, value in (("window", window), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if stride > window:
        raise ValueError(f"stride {stride} is larger than window {window}: tokens would go unscored")
    n = ids.shape[1]
    if lm.max_positions is not None and min(window, n) > lm.max_positions:
        raise ValueError(f"window {window} exceeds the model's max_positions {lm.max_positions}")
    if n < 2:
        raise ValueError("perplexity needs at least two tokens")
    starts = []
    for start in range(0, n, stride):
        starts.append(start)
        if start + window >= n:
            break
    total, scored, end_before = 0.0, 0, 0
    for done, start in enumerate(starts, 1):
        end = min(start + window, n)
        new = min(end - end_before, end - start - 1)  # a window's first token has no prediction in it
        chunk = ids[:, start:end]
        logprobs = torch.log_softmax(lm.forward(chunk)[0, -new - 1:-1], dim=-1)
        targets = chunk[0, -new:].to(logprobs.device)
        total -= float(logprobs.gather(1, targets[:, None]).sum())
        scored += new
        end_before = end
        if progress:
            progress(done, len(starts))
    return Perplexity(math.exp(total / scored), total / scored, scored)
