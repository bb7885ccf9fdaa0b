"""The runner: one scheduled step as model forwards, returning the logits of the sequences that sample.

A transformer step is one forward over every scheduled token of every sequence, laid out in one row, its keys
and values read and written through block tables. A recurrent model keeps one state per running sequence in a
slot of a preallocated state: decodes run as one batch, prompt chunks one sequence at a time.
"""

import torch

from ..blocks.mamba1 import SCAN_CHUNK
from ..formats import row_invariant
from ..model import CausalLMState


class Runner:
    def __init__(self, model, n_blocks: int, block_size: int, max_running: int):
        self.model, self.block_size = model, block_size
        self.recurrent = model.rotary is None
        if self.recurrent:
            self.states = model.allocate_state(max_running, None).layers
            self.chunk_align = model.plan.block_options.get("chunk_size", SCAN_CHUNK)
        else:
            self.pages = model.allocate_pages(n_blocks, block_size)
            self.chunk_align = 1

    def run(self, batch) -> tuple[list, torch.Tensor]:
        """batch: [(seq, n)], n tokens of seq to compute. Returns the seqs whose tokens are then all computed and
        their logits (len(seqs), vocab), one row each, so that a step's greedy rows are chosen in one call."""
        with torch.no_grad(), row_invariant():
            return self._recurrent(batch) if self.recurrent else self._paged(batch)

    def _paged(self, batch):
        size, device = self.block_size, self.model.device
        ids, positions, seqs, slots, rows, sampled = [], [], [], [], [], []
        for i, (seq, n) in enumerate(batch):
            start = seq.n_computed
            ids += seq.tokens[start:start + n]
            positions += range(start, start + n)
            seqs += [i] * n
            slots += [seq.kv.blocks[p // size] * size + p % size for p in range(start, start + n)]
            if start + n == len(seq.tokens):
                rows.append(len(ids) - 1)
                sampled.append(seq)
        width = max(len(seq.kv.blocks) for seq, _ in batch)
        tables = [seq.kv.blocks + [0] * (width - len(seq.kv.blocks)) for seq, _ in batch]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        logits = self.model.forward_paged(as_tensor(ids), as_tensor(positions), as_tensor(seqs), as_tensor(tables),
                                          as_tensor(slots), self.pages, as_tensor(rows))
        return sampled, logits

    def _recurrent(self, batch):
        seqs, rows = [], []
        decodes = [seq for seq, n in batch if n == 1 and seq.n_computed > 0]
        if decodes:
            ids = [[seq.tokens[-1]] for seq in decodes]
            seqs += decodes
            rows.append(self._forward([seq.slot for seq in decodes], ids, 1))
        for seq, n in batch:
            if n > 1 or seq.n_computed == 0:
                ids = [seq.tokens[seq.n_computed:seq.n_computed + n]]
                logits = self._forward([seq.slot], ids, seq.n_computed)
                if seq.n_computed + n == len(seq.tokens):
                    seqs.append(seq)
                    rows.append(logits)
        return seqs, torch.cat(rows) if rows else torch.empty(0, self.model.vocab_size)

    def _forward(self, slots, ids, start):
        """Rows of ids continuing the states in `slots` (start 0: from fresh states); their last logits."""
        device = self.model.device
        index = torch.tensor(slots, device=device)
        layers = [type(c)(c.conv[index], c.ssm[index]) for c in self.states]
        state = CausalLMState(len(slots), None, layers, owner=self.model, length=start)
        logits = self.model._run(torch.tensor(ids, device=device), state, last_only=True)[:, -1].float()
        for pool, layer in zip(self.states, layers):
            pool.conv[index], pool.ssm[index] = layer.conv, layer.ssm
        return logits
