"""The scheduler: which sequences run in the next step, and how many of their tokens.

Every step, each running sequence whose tokens are all computed decodes one token; within `max_prefill_tokens`
prompt tokens a step, waiting sequences whose prompts fit whole are admitted first (so a short prompt never waits
behind a long one's chunks), then sequences still prefilling take chunks of their prompt, then more waiting
sequences are admitted, oldest first, while there is room. When the KV pool runs short, the newest running sequence
is preempted: its blocks are released and it waits to be computed again (its full blocks stay cached, so it often
finds them again).
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
    n_computed: int = 0  # tokens whose keys and values (or recurrent state) are computed
    kv: Sequence = field(default_factory=Sequence)
    slot: int | None = None  # recurrent models: the state slot it holds while running
    leader: "Seq | None" = None  # another sample of the same prompt: its prefilled blocks are shared

    @property
    def prefilling(self) -> bool:
        return self.n_computed < self.n_prompt

    def __lt__(self, other):
        return self.arrival < other.arrival


class Scheduler:
    def __init__(self, pool: BlockPool | None, max_running: int, max_prefill_tokens: int, chunk_align: int = 1):
        self.pool = pool  # None: a recurrent model, whose states take no blocks
        self.max_running, self.max_prefill_tokens, self.chunk_align = max_running, max_prefill_tokens, chunk_align
        self.waiting: list[Seq] = []  # by arrival
        self.running: list[Seq] = []  # by arrival: the newest is preempted first
        self.free_slots = list(range(max_running))
        self.preemptions = 0

    def add(self, seq: Seq):
        bisect.insort(self.waiting, seq)

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
        batch: dict[Seq, int] = {}
        prefilling = []
        for seq in list(self.running):  # decodes first: they take none of the prefill budget
            if seq not in self.running:  # preempted for an older one
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
        """Put n tokens of seq in the batch, preempting the newest running sequences while the pool is short."""
        while not self._grow(seq, seq.n_computed + n):
            victim = self.running[-1]
            self._preempt(victim)
            batch.pop(victim, None)
            if victim is seq:
                return False
        batch[seq] = n
        return True

    def _admit(self, batch: dict, budget: int, *, whole: bool) -> int:
        """Admit waiting sequences, oldest first, while there is room (whole: only while the oldest's prompt fits
        the budget whole); the budget left."""
        while self.waiting and len(self.running) < self.max_running and budget > 0:
            seq = self.waiting[0]
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
            self.waiting.pop(0)
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
