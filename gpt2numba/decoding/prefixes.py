"""PrefixCache: the keys and values of recent prompts, kept in blocks of BLOCK tokens and found by prefix.

A server's clients send the same system text or few-shot examples again and again. A new prompt
takes the longest run of whole blocks it shares with prompts seen before, read in place (not copied),
and prefills only the rest,
as vLLM's automatic prefix caching does. A block is found by its own tokens and the block before it,
so a block stands for the whole prefix up to its end, matched exactly (no hash that could collide).
Memory is bounded: past ``max_bytes`` the least recently used block goes, and since a block is always
used together with the blocks before it, the deepest ones go first and every block kept is reachable.
Not thread-safe: the batch that owns it (batching.Batch, the server's engine thread) is its only user.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ..model.config import GPT2Config
from ..model.kvcache import ModelCache, check_kv_dtype

BLOCK = 16  # tokens a block: vLLM's default block size


@dataclasses.dataclass(eq=False)
class _Block:
    key: tuple  # (the block before it, or None at the start; its BLOCK token ids)
    k: np.ndarray  # (n_layer, n_head, BLOCK, head_dim)
    v: np.ndarray  # (n_layer, n_head, BLOCK, head_dim)


class PrefixCache:
    """At most ``max_bytes`` of prompt blocks; ``load`` a prompt's longest cached prefix, ``store`` a prompt.
    Its blocks are rows of caches of ``kv_dtype`` (kvcache.KV_DTYPES), kept as stored (2 bytes a value for
    float16 and bfloat16), and go only to caches of that dtype."""

    def __init__(self, config: GPT2Config, max_bytes: int, kv_dtype: str = "float32"):
        self.config, self.kv_dtype = config, check_kv_dtype(kv_dtype)
        self.block_bytes = ModelCache(config, BLOCK, kv_dtype).nbytes
        self.max_blocks = max(0, int(max_bytes) // self.block_bytes)
        self._index: dict[tuple, _Block] = {}
        self._recent: collections.OrderedDict[_Block, None] = collections.OrderedDict()  # least recent first
        self.lookups = self.hits = self.hit_tokens = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return len(self._recent) * self.block_bytes

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._recent)

    def load(self, ids: list[int], cache: ModelCache) -> int:
        """Fill an empty ``cache`` with the longest cached prefix of ``ids`` in whole blocks, always leaving
        at least the last id to be fed (its logits are what the prompt is for); returns the positions filled."""
        assert cache.length == 0 and cache.config == self.config and cache.dtype == self.kv_dtype
        self.lookups += 1
        chain = self._chain(ids)
        for block in chain:  # read in place: a block is never written once stored
            cache._extend_shared(block.k, block.v)
        self._touch(chain)
        if chain:
            self.hits += 1
            self.hit_tokens += len(chain) * BLOCK
        return len(chain) * BLOCK

    def cached(self, ids: list[int]) -> int:
        """The positions ``load`` would fill for ``ids`` now (nothing counted, nothing touched)."""
        return len(self._chain(ids)) * BLOCK

    def _chain(self, ids: list[int]) -> list[_Block]:
        """The cached blocks of ids' longest cached prefix in whole blocks, leaving at least the last id."""
        chain, parent = [], None
        for start in range(0, len(ids) - 1 - BLOCK + 1, BLOCK):
            block = self._index.get((parent, tuple(ids[start : start + BLOCK])))
            if block is None:
                break
            chain.append(block)
            parent = block
        return chain

    def store(self, ids: list[int], cache: ModelCache) -> None:
        """Keep the whole blocks of the prompt ``ids``, whose rows ``cache`` holds from position 0."""
        assert cache.length >= len(ids) // BLOCK * BLOCK and cache.config == self.config \
            and cache.dtype == self.kv_dtype
        chain, parent = [], None
        for start in range(0, min(len(ids) // BLOCK, self.max_blocks) * BLOCK, BLOCK):
            key = (parent, tuple(ids[start : start + BLOCK]))
            block = self._index.get(key)
            if block is None:
                if len(self._recent) >= self.max_blocks and not self._evict(chain):
                    break
                k, v = cache._rows(start, start + BLOCK)
                block = _Block(key, k.copy(), v.copy())
                self._index[key] = block
            self._recent[block] = None  # (most recent for now: kept while the rest of the chain is stored)
            self._recent.move_to_end(block)
            chain.append(block)
            parent = block
        self._touch(chain)

    def _touch(self, chain: list[_Block]) -> None:
        """Used now: the deepest block first, so that each block is more recent than every block after it."""
        for block in reversed(chain):
            self._recent.move_to_end(block)

    def _evict(self, chain: list[_Block]) -> bool:
        """Drop the least recently used block, unless it is one of ``chain`` (the prompt being stored)."""
        block = next(iter(self._recent))
        if block in chain:
            return False
        del self._recent[block]
        del self._index[block.key]
        self.evictions += 1
        return True
