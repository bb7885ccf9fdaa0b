"""The one place a token is chosen: logits processors in order, then the sampler.

`CausalLM.generate` and `stream`, prompt lookup and the engine each make one `Decoder` per generation (the
engine one per request) and hand it every step's logits. The processors rewrite the float32 logits in a fixed
order: OpenAI's presence and frequency penalties, transformers' repetition penalty, OpenAI's logit bias, a
grammar's mask. Then the sampler draws, and every processor sees the chosen tokens. A new constraint is one more
processor: an object with `__call__(logits) -> logits` and `accept(tokens)` (tokens (B,), -1 for a row that has
stopped).

A grammar's mask is lazy where that is exact (grammar.py): the sampler draws from the unmasked logits, and only
rows whose token the grammar refuses draw again from their masked logits. Greedy: masking only lowers refused
tokens to -inf, so an allowed argmax of the unmasked row is the argmax of the masked row too (ties included:
argmax takes the first maximum, and every entry before it stays below it). Sampling from the tempered
distribution p uncut: token t allowed comes out with p(t) + P(refused) * p(t) / P(allowed) = p(t) / P(allowed),
the masked distribution (rejection sampling), seed for seed deterministic. Top-k/top-p/min-p cut the distribution
by ranks the mask would change, and logprobs are of the masked distribution, so those keep the eager mask.
"""

import torch

from .sampling import Sampler


class PresenceFrequencyPenalty:
    """OpenAI's penalties, over the tokens made so far (not the prompt): presence once, frequency per time seen."""

    def __init__(self, presence: float, frequency: float, batch: int, vocab: int, device):
        self.presence, self.frequency = presence, frequency
        self.counts = torch.zeros(batch, vocab, device=device)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits - self.presence * (self.counts > 0) - self.frequency * self.counts

    def accept(self, tokens: torch.Tensor):
        rows = (tokens >= 0).nonzero()[:, 0]
        self.counts[rows, tokens[rows]] += 1


class RepetitionPenalty:
    """transformers' penalty, over the prompt and the tokens made: a seen token's positive logit divided by it,
    a negative one multiplied."""

    def __init__(self, penalty: float, seen: torch.Tensor):
        self.penalty, self.seen = penalty, seen  # seen: (B, vocab) bool, the prompts' tokens marked

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        penalized = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(self.seen, penalized, logits)

    def accept(self, tokens: torch.Tensor):
        rows = (tokens >= 0).nonzero()[:, 0]
        self.seen[rows, tokens[rows]] = True


class LogitBias:
    """OpenAI's logit_bias: a number added to given tokens' logits (-100 bans a token, 100 all but forces it)."""

    def __init__(self, bias: dict, device):
        self.ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_add(1, self.ids, self.values.expand(logits.shape[0], -1))

    def accept(self, tokens: torch.Tensor):
        pass


class Decoder:
    """A generation's token choice: its processors, its sampler and its random stream.

    `choose(logits)` takes (B, vocab) logits and returns (B,) tokens; rows in `done` get -1 and are not
    shown to the processors. `logprobs()` is the log-distribution the last tokens were drawn from (after the
    processors and the temperature, before top-k/top-p/min-p truncation; greedy: temperature 1), which needs an
    eager mask (build with logprobs=True). `ended` marks rows whose constraint is complete (no token but the end
    may follow).
    """

    def __init__(self, sampler: Sampler, processors=(), device="cpu", mask=None):
        self.sampler, self.processors = sampler, [p for p in processors if p is not None]
        self.mask = mask  # the constraint's processor, applied last: grammar.GrammarMask, eager or lazy
        self.generator = sampler.generator(device)
        self.last: torch.Tensor | None = None
        self.ended: torch.Tensor | None = None

    @classmethod
    def build(cls, sampler: Sampler, prompts, vocab: int, device, *, presence: float = 0.0, frequency: float = 0.0,
              logit_bias: dict | None = None, constraint=None, logprobs: bool = False) -> "Decoder":
        """The chain for rows of `prompts` (lists of token ids): the penalties asked for, the logit bias
        ({token id: number}), then the constraint's mask (a grammar.Grammar, one matcher per row), lazy unless
        `logprobs` (they will be asked for) or the sampler truncates."""
        batch, processors = len(prompts), []
        if presence or frequency:
            processors.append(PresenceFrequencyPenalty(presence, frequency, batch, vocab, device))
        if sampler.repetition_penalty != 1:
            seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
            for row, prompt in enumerate(prompts):
                seen[row, torch.as_tensor(list(prompt), dtype=torch.long, device=device)] = True
            processors.append(RepetitionPenalty(sampler.repetition_penalty, seen))
        if logit_bias:
            processors.append(LogitBias(logit_bias, device))
        lazy = not logprobs and not sampler.truncates
        mask = constraint.mask(batch, lazy) if constraint is not None else None
        return cls(sampler, processors, device, mask)

    @property
    def argmax_only(self) -> bool:
        """Greedy with no processor and no constraint: choose's token is the logits' argmax, and it keeps no
        state, so a caller may take many such rows' tokens in one argmax without calling it."""
        return self.sampler.greedy and not self.processors and self.mask is None

    def choose(self, logits: torch.Tensor, done: torch.Tensor | None = None) -> torch.Tensor:
        x = logits.float()  # as transformers computes, and faster
        for processor in self.processors:
            x = processor(x)
        lazy = self.mask is not None and self.mask.lazy
        if self.mask is not None and not lazy:
            x = self.mask(x)
        self.last = None if lazy else x
        tokens = self.sampler.draw(x, self.generator).to(logits.device)
        if done is not None:
            tokens = tokens.masked_fill(done, -1)
        if lazy and (rows := self.mask.refused(tokens)):
            tokens[rows] = self.sampler.draw(self.mask.masked(x[rows], rows), self.generator).to(logits.device)
        ended = None
        for processor in self.processors + [self.mask]:
            if processor is None:
                continue
            processor.accept(tokens)
            if (stopped := getattr(processor, "ended", None)) is not None:
                ended = stopped.to(tokens.device)
        self.ended = ended
        return tokens

    def logprobs(self) -> torch.Tensor:
        """(B, vocab) float32 log-probabilities of the distribution the last tokens came from."""
        if self.last is None:
            raise RuntimeError("logprobs need a decoder built with logprobs=True (its mask eager)")
        return (self.last / (self.sampler.temperature or 1.0)).log_softmax(-1)
