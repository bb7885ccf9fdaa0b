"""Prompt lookup decoding: draft tokens copied from the prompt and the text so far, checked in one forward.

Text that repeats what came before (a quoted passage, an edit of it, code) is cheap to guess: the tokens that
followed the first earlier occurrence of the last n tokens (the longest n up to `lookup_ngram` that occurred).
One forward over the last token and up to `prompt_lookup` drafts gives the logits after each; the sampler keeps
the drafts up to the first it would not have chosen, then its own choice there, and the KV cache is cut back to
what was kept (slots past the state's length are never read, and the next forward overwrites them). A forward
reads the weights once for all its tokens, so each kept draft saves most of a step.

The output is the plain generation's, token for token, sampled ones included (the same seed draws the same
tokens), because the checking forward gives each position bit for bit the logits of a one-token step: its
matmuls run under formats.row_invariant (a row's arithmetic does not depend on the rows beside it), each query
attends through the one-token decode kernel, and rotary tables and masks are made per position; each token is
then chosen from its row as the plain loop chooses it. Where that cannot hold it is refused (PromptLookupError),
never approximated: a recurrent model (its multi-token scan is not its step, and its state cannot be cut back),
a batch of more than one row, a model off CPU or without lmstack's kernels, weights whose matmul is not row
invariant.
"""

import torch

from . import kernels
from .formats import row_invariant

DEFAULT_NGRAM = 3


class PromptLookupError(ValueError):
    """Prompt lookup asked where its verification could not give the plain generation's tokens."""


class NgramIndex:
    """The tokens so far, and where each of their n-grams (1 to max_ngram tokens) first ends."""

    def __init__(self, max_ngram: int, tokens=()):
        self.max_ngram, self.tokens, self.ends = max_ngram, [], {}
        for token in tokens:
            self.append(token)

    def append(self, token: int):
        self.tokens.append(token)
        end = len(self.tokens)
        for n in range(1, min(self.max_ngram, end) + 1):
            self.ends.setdefault(tuple(self.tokens[end - n:]), end)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the first earlier occurrence of the longest n-gram the tokens end with."""
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), 0, -1):
            first = self.ends[tuple(self.tokens[end - n:])]
            if first < end:
                return self.tokens[first:first + k]
        return []


def check(model, batch_size: int, prompt_lookup, lookup_ngram):
    """Refuse bad values, and prompt lookup where the model's verifying forward could not be exact."""
    for name, value, low in (("prompt_lookup", prompt_lookup, 0), ("lookup_ngram", lookup_ngram, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    reason = prompt_lookup and _inexact(model, batch_size)
    if reason:
        raise PromptLookupError(f"prompt_lookup: {reason}; generate without it for the same tokens")


def _inexact(model, batch_size: int) -> str | None:
    """Why a multi-token forward of this model could give other logits than its one-token steps (None: it cannot)."""
    if model.rotary is None:
        return (f"a {model.kind} model's multi-token scan is not its one-token step and its state cannot be cut "
                "back, so its drafts cannot be checked exactly")
    if batch_size != 1:
        return f"it takes one prompt at a time, got a batch of {batch_size}"
    off_cpu = sorted({str(d) for d in model.layer_devices if d.type != "cpu"})
    if off_cpu:
        return f"it runs on CPU only (lmstack's row-invariant kernels), the model is on {', '.join(off_cpu)}"
    if not kernels.available():
        return "it needs lmstack's CPU kernels (kernels.py), which do not run on this machine"
    for module in [*(b.get_submodule(p) for b in model.blocks for p in b.PROJECTIONS), model.head_projection]:
        if not getattr(module, "row_invariant", False):
            return (f"weight_format {model.weight_format!r} in profile {model.numeric_profile!r} multiplies with "
                    f"{type(module).__name__}, whose rows' arithmetic depends on how many share a call")
    return None


@torch.no_grad()
def decode(model, ids, state, max_new_tokens: int, decoder, eos, until, prompt_lookup: int, lookup_ngram: int):
    """Yield each new token (1,) as CausalLM._decode does, checking drafts of up to prompt_lookup tokens.

    Each kept token is the one the decoder chooses from its row after the tokens before it, so a grammar's
    mask applies to drafts as to plain steps: a draft the grammar forbids is never chosen, and is cut there."""
    device = model.device
    index = NgramIndex(lookup_ngram, ids[0].tolist())
    rows, draft, made = model._run(ids, state, last_only=True)[0], [], 0  # rows[i]: the logits after fed token i
    while True:
        for i in range(len(rows)):
            token = decoder.choose(rows[i:i + 1])
            done = torch.isin(token, eos)
            if decoder.ended is not None:
                done |= decoder.ended
            if until is not None:
                done |= until(token)
            yield token
            made += 1
            if done.all() or made == max_new_tokens:
                return
            index.append(int(token))
            if i == len(draft) or int(token) != draft[i]:
                break
        state.length -= len(draft) - i  # the drafts not kept
        draft = index.draft(min(prompt_lookup, max_new_tokens - made - 1))  # what the state still holds
        with row_invariant():
            rows = model._run(torch.tensor([[int(token), *draft]], device=device), state, alone=True)[0]
