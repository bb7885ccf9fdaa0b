"""The scheduler: which sequences run in the next step, and how many of their tokens.

Every step, each running sequence whose tokens are all computed decodes one token; within `max_prefill_tokens`
prompt tokens a step, waiting sequences whose prompts fit whole are admitted first (so a short prompt never waits
behind a long one's chunks), then sequences still prefilling take chunks of their prompt, then more waiting
sequences are admitted while there is room.

Waiting sequences are admitted in rank order: the step a request arrived plus its expected work (prompt tokens +
max_tokens), so the request with less work goes first, and each step waited counts as one token of work less:
a long request is overtaken only by requests that arrived fewer steps after it than it has extra work, so it
never starves. `short_slots` of the `max_running` slots are kept for short requests (a prompt that one step
computes whole, at most `short_tokens` tokens to make), taken by the short request of least work: however long
the running requests are, one of those slots is free again within `short_tokens` steps, so a quick question
(a one-token completion, a health probe through the model) gets its answer while long ones stream.

When the KV pool runs short, the running sequence of the highest rank is preempted: its blocks are released and
it waits to be computed again, keeping its rank (its full blocks stay cached, so it often finds them again).
"""

import bisect
from dataclasses import dataclass, field

from .kv_cache import BlockPool, Sequence


@dataclass(eq=False)
class Seq:
    """A request as the scheduler and runner see it."""

    arrival: int
    tokens: list  # prompt, then every token made
    n_prompt: int
    max_tokens: int = 1
    rank: int = 0  # admission order, lowest first: the scheduler's step at arrival + work
    n_computed: int = 0  # tokens whose keys and values (or recurrent state) are computed
    kv: Sequence = field(default_factory=Sequence)
    slot: int | None = None  # recurrent models: the state slot it holds while running
    leader: "Seq | None" = None  # another sample of the same prompt: its prefilled blocks are shared

    @property
    def prefilling(self) -> bool:
        return self.n_computed < self.n_prompt

    @property
    def work(self) -> int:
        """Tokens it computes at most: its prompt and every token it may make."""
        return self.n_prompt + self.max_tokens

    def __lt__(self, other):
        return (self.rank, self.arrival) < (other.rank, other.arrival)


class Scheduler:
    def __init__(self, pool: BlockPool | None, max_running: int, max_prefill_tokens: int, chunk_align: int = 1,
                 short_slots: int = 0, short_tokens: int = 8):
        self.pool = pool  # None: a recurrent model, whose states take no blocks
        self.max_running, self.max_prefill_tokens, self.chunk_align = max_running, max_prefill_tokens, chunk_align
        self.short_slots, self.short_tokens = short_slots, short_tokens
        self.waiting: list[Seq] = []  # by rank
        self.running: list[Seq] = []  # by rank: the highest is preempted first
        self.free_slots = list(range(max_running))
        self.preemptions = 0
        self.steps = 0

    def add(self, seq: Seq):
        seq.rank = self.steps + seq.work
        bisect.insort(self.waiting, seq)

    def short(self, n_prompt: int, max_tokens: int) -> bool:
        """Whether a request of n_prompt tokens making at most max_tokens may take a slot kept for short requests:
        one step computes its prompt whole, and it leaves the slot within short_tokens steps."""
        return max_tokens <= self.short_tokens and n_prompt <= self.max_prefill_tokens

    def remove(self, seq: Seq):
        """Take seq out of the queues (finished or aborted) and release what it holds."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _release(self, seq: Seq):
        if self.pool is not None:
            self.pool.release(seq.kv)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def _chunk(self, left: int, budget: int) -> int:
        """Tokens to compute this step of the `left` a sequence has: all, or a chunk of them within the budget."""
        if left <= 1 or left <= budget:
            return left
        align = self.chunk_align  # recurrent models: chunk boundaries where their scans' chunks fall
        n = min(left, max(align, budget // align * align))
        if left - n == 1 and align > 1:  # a last chunk of one token would take Mamba 2's one-step path
            n = n - align if n > align else left
        return n

    def _grow(self, seq: Seq, n_tokens: int) -> bool:
        return self.pool is None or self.pool.grow(seq.kv, n_tokens)

    def schedule(self) -> list[tuple[Seq, int]]:
        """(sequence, number of its next tokens to compute) for the next step."""
        self.steps += 1
        batch: dict[Seq, int] = {}
        prefilling = []
        for seq in list(self.running):  # decodes first: they take none of the prefill budget
            if seq not in self.running:  # preempted for one ranked before it
                continue
            if len(seq.tokens) - seq.n_computed > 1:
                prefilling.append(seq)
            else:
                self._place(batch, seq, 1)
        budget = self._admit(batch, self.max_prefill_tokens, whole=True)  # short prompts before long ones' chunks
        for seq in prefilling:
            if seq in self.running and budget > 0:
                n = self._chunk(len(seq.tokens) - seq.n_computed, budget)
                if self._place(batch, seq, n):
                    budget -= n
        self._admit(batch, budget, whole=False)
        return list(batch.items())

    def _place(self, batch: dict, seq: Seq, n: int) -> bool:
        """Put n tokens of seq in the batch, preempting the highest-ranked running sequences while the pool is
        short."""
        while not self._grow(seq, seq.n_computed + n):
            victim = self.running[-1]
            self._preempt(victim)
            batch.pop(victim, None)
            if victim is seq:
                return False
        batch[seq] = n
        return True

    def _next(self) -> Seq | None:
        """The waiting sequence a free slot takes: the first in rank while a slot is free for any request, else,
        while one kept for short requests is, the short one of least work."""
        def short(seq):
            return self.short(seq.n_prompt, seq.max_tokens)

        if not self.waiting or len(self.running) >= self.max_running:
            return None
        if sum(not short(seq) for seq in self.running) < self.max_running - self.short_slots:
            return self.waiting[0]
        return min((seq for seq in self.waiting if short(seq)), key=lambda seq: (seq.work, seq), default=None)

    def _admit(self, batch: dict, budget: int, *, whole: bool) -> int:
        """Admit waiting sequences (_next) while there is room (whole: only while the next one's prompt fits the
        budget whole); the budget left."""
        while budget > 0 and (seq := self._next()) is not None:
            if self.pool is not None and seq.leader in self.running and seq.leader.prefilling:
                break  # once its leader's prompt is computed, its full blocks are found in the prefix cache
            hits = []
            if self.pool is not None:  # a cached prefix, short of the last token, whose logits are needed
                hits = self.pool.match(seq.tokens[:len(seq.tokens) - 1])
            cached = len(hits) * (self.pool.block_size if self.pool else 0)
            left = len(seq.tokens) - cached
            if whole and left > budget:
                break
            n = self._chunk(left, budget)
            if self.pool is not None and self.pool.cost(hits, cached + n) > self.pool.n_free:
                break
            self.waiting.remove(seq)
            if self.pool is not None:
                self.pool.admit(seq.kv, hits, len(seq.tokens) // self.pool.block_size)
                self.pool.grow(seq.kv, cached + n)
            else:
                seq.slot = self.free_slots.pop()
            seq.n_computed = cached
            bisect.insort(self.running, seq)
            batch[seq] = n
            budget -= n
        return budget

    def _preempt(self, seq: Seq):
        self.running.remove(seq)
        self._release(seq)
        seq.n_computed = 0
        bisect.insort(self.waiting, seq)
        self.preemptions += 1
