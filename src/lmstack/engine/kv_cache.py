"""The block manager: which KV blocks of the pool each sequence owns, and which full blocks are cached for reuse.

A full block is keyed by (its parent block's key, its token ids), so a key stands for the whole prefix up to the
block's end. Blocks are reference counted; a released block keeps its key and contents until the pool needs it,
least recently released first, so a later prompt with the same prefix reuses it instead of computing it again.
A block never used yet is taken only when no released one is left: the pool's memory is touched (made resident)
as far as the most blocks ever held at once need, not further with every request.
"""

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Block:
    refs: int = 0
    key: int | None = None  # set once the block is full and its keys and values are written
    parent: int | None = None  # the previous block's key
    tokens: tuple = ()


@dataclass
class Sequence:
    """What the block manager tracks of one sequence: its blocks in order and the keys of its full ones."""

    blocks: list = field(default_factory=list)
    keys: list = field(default_factory=list)  # key of each of the first len(keys) blocks


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block() for _ in range(n_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict()  # released blocks, least recently released first
        self.unused = list(range(n_blocks - 1, -1, -1))  # blocks never used, the lowest last (taken first)
        self.cached: dict[int, int] = {}  # key -> block
        self.queries = self.hits = 0  # full prompt blocks looked up, and found

    @property
    def n_free(self) -> int:
        return len(self.free) + len(self.unused)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _key(self, parent: int | None, tokens: tuple) -> int:
        return hash((parent, tokens))

    def match(self, tokens: list) -> list[int]:
        """The cached blocks that hold a prefix of `tokens`, in order (none are taken yet)."""
        found, parent, size = [], None, self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            chunk = tuple(tokens[start:start + size])
            key = self._key(parent, chunk)
            block = self.cached.get(key)
            if block is None or self.blocks[block].tokens != chunk or self.blocks[block].parent != parent:
                break
            found.append(block)
            parent = key
        return found

    def cost(self, hits: list[int], n_tokens: int) -> int:
        """Free blocks a sequence reusing `hits` and holding n_tokens would take from the pool."""
        return self.blocks_for(n_tokens) - len(hits) + sum(self.blocks[b].refs == 0 for b in hits)

    def admit(self, seq: Sequence, hits: list[int], full_prompt_blocks: int):
        """Give seq the cached blocks `hits` (a prefix of its prompt, which has full_prompt_blocks full blocks)."""
        self.queries += full_prompt_blocks
        self.hits += len(hits)
        for b in hits:
            if self.blocks[b].refs == 0:
                del self.free[b]
            self.blocks[b].refs += 1
            seq.keys.append(self.blocks[b].key)
        seq.blocks.extend(hits)

    def grow(self, seq: Sequence, n_tokens: int) -> bool:
        """Give seq blocks for n_tokens tokens in all; False (and nothing taken) if the pool is short."""
        need = self.blocks_for(n_tokens) - len(seq.blocks)
        if need > self.n_free:
            return False
        for _ in range(need):
            b = self.free.popitem(last=False)[0] if self.free else self.unused.pop()
            block = self.blocks[b]
            if block.key is not None and self.cached.get(block.key) == b:
                del self.cached[block.key]
            block.refs, block.key, block.parent, block.tokens = 1, None, None, ()
            seq.blocks.append(b)
        return True

    def seal(self, seq: Sequence, tokens: list, n_computed: int):
        """Key the blocks of seq that n_computed tokens filled, so later sequences can reuse them."""
        size = self.block_size
        while len(seq.keys) < n_computed // size:
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else None
            chunk = tuple(tokens[i * size:(i + 1) * size])
            key = self._key(parent, chunk)
            b = seq.blocks[i]
            if key not in self.cached:  # else an equal block is cached already: this one stays private
                self.cached[key] = b
                block = self.blocks[b]
                block.key, block.parent, block.tokens = key, parent, chunk
            seq.keys.append(key)

    def release(self, seq: Sequence):
        """Drop seq's references; blocks nobody holds go to the free list, cached ones keeping their contents."""
        for b in reversed(seq.blocks):  # a prefix's last blocks are evicted before its first
            block = self.blocks[b]
            block.refs -= 1
            if block.refs == 0:
                self.free[b] = None
        seq.blocks.clear()
        seq.keys.clear()
