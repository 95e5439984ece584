"""Paged KV-cache bookkeeping: KV-cache groups, block pools, block tables, prefix caching.

The cache is paged as in vLLM (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention"): K/V live in fixed-size blocks of
``block_size`` tokens; a request's *block table* maps its logical block ``i`` (tokens
``i*bs .. i*bs+bs-1``) to a physical block; the *slot* of token ``p`` is
``table[p // bs] * bs + p % bs``.

**KV-cache groups.** Layers whose K/V have the same shape and the same attention span
(full, or one sliding window) form a group, with its own block pool and its own block
table per request. A hybrid model such as Step-3.5-Flash (12 full-attention layers and
33 sliding-window layers, STEP35.md) has two groups; the sliding group only keeps the
blocks that are still inside some query's window: once every token of a block lies
before ``next_position - window + 1`` it is released (its table entry becomes -1). So
a long sequence holds ``O(context)`` blocks in the full group but ``O(window)`` blocks
in the sliding group, and the sliding pool is sized for that (:func:`plan_kv_blocks`).

**Prefix caching** (vLLM automatic prefix caching, SGLang RadixAttention in spirit):
every *full* block of a request's tokens gets a chained hash
``h_i = sha256(h_{i-1} || token ids of block i)``; a computed full block is registered
under its hash in each group's pool. A released block keeps its hash and stays cached
(evictable, least recently freed first) until its memory is needed. A new request reuses
the longest prefix whose blocks are cached in *every* group — for a sliding group only
the blocks inside the window of the first recomputed token are needed.

Errors are never silent: a request that can never fit is rejected up front by
:meth:`KVCacheManager.check_fits` (``KVCapacityError``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..config import ModelConfig

__all__ = ["KVGroupSpec", "kv_groups", "layer_groups", "BlockPool", "KVCacheManager", "KVCapacityError", "plan_kv_blocks",
           "NULL_BLOCK"]

NULL_BLOCK = -1


class KVCapacityError(ValueError):
    """A request needs more KV-cache blocks than the whole pool has."""


@dataclass(frozen=True)
class KVGroupSpec:
    """Layers that share one block pool: same KV heads, head_dim and attention span.

    Attributes:
        layers: model layer indices in this group.
        window: sliding window in tokens, or None for full attention.
        num_kv_heads, head_dim: K/V geometry of every layer in the group.
    """

    layers: tuple[int, ...]
    window: int | None
    num_kv_heads: int
    head_dim: int

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of this group: K and V for ``block_size`` tokens in every layer."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * len(self.layers) * block_size * self.num_kv_heads * self.head_dim * elem

    def max_blocks_per_seq(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one sequence of ``num_tokens`` tokens holds at once, prefilled in chunks of
        at most ``chunk`` tokens (a sliding group holds the window before the chunk plus the chunk)."""
        full = -(-num_tokens // block_size)
        if self.window is None:
            return full
        return min(full, -(-(self.window - 1 + min(chunk, num_tokens)) // block_size) + 1)


def kv_groups(config: ModelConfig) -> list[KVGroupSpec]:
    """The model's KV-cache groups, in order of first layer."""
    return layer_groups(config.layers)


def layer_groups(layers: list) -> list[KVGroupSpec]:
    """KV-cache groups of the attention layers ``layers`` (``LayerConfig``; layer i = attention index i)."""
    keys: dict[tuple, list[int]] = {}
    for i, lc in enumerate(layers):
        keys.setdefault((lc.sliding_window, lc.num_kv_heads, lc.head_dim), []).append(i)
    return [KVGroupSpec(tuple(ls), w, kvh, d) for (w, kvh, d), ls in keys.items()]


def plan_kv_blocks(groups: list[KVGroupSpec], block_size: int, dtype: torch.dtype, *, num_blocks: int | None = None,
                   memory_bytes: int | None = None, max_num_seqs: int, max_num_batched_tokens: int,
                   max_model_len: int) -> list[int]:
    """Blocks per group.

    Sliding-window groups get what ``max_num_seqs`` sequences can hold at once (each
    keeps at most ``window - 1`` earlier tokens plus its chunk, and the chunks of one
    step add up to ``max_num_batched_tokens``), never more than a full group; full
    groups get the rest.

    Args:
        num_blocks: blocks of each full-attention group (``--kv-cache-blocks``); or
        memory_bytes: total bytes for the whole cache (``--kv-cache-memory``).
    Returns:
        Block count per group (same order as ``groups``).
    Raises:
        ValueError: neither or both sizes given, or too little memory for one full-length sequence.
    """
    if (num_blocks is None) == (memory_bytes is None):
        raise ValueError("give exactly one of num_blocks (--kv-cache-blocks) and memory_bytes (--kv-cache-memory)")
    # a sliding sequence holds ceil((window - 1 + chunk) / bs) + 1 blocks at most; summed over the
    # step's sequences that is at most seqs * (ceil((window - 1) / bs) + 2) + ceil(step tokens / bs)
    caps = [None if g.window is None else
            min(max_num_seqs * g.max_blocks_per_seq(max_model_len, block_size, max_num_batched_tokens),
                max_num_seqs * (-(-(g.window - 1) // block_size) + 2) + -(-max_num_batched_tokens // block_size))
            for g in groups]

    def counts(n: int) -> list[int]:
        return [n if c is None else min(n, c) for c in caps]

    def nbytes(cs: list[int]) -> int:
        return sum(g.block_bytes(block_size, dtype) * c for g, c in zip(groups, cs))

    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(f"kv cache blocks = {num_blocks} must be >= 1")
        out = counts(num_blocks)
    else:
        lo, hi = 0, memory_bytes // min(g.block_bytes(block_size, dtype) for g in groups) + 1
        while lo < hi:  # the largest n whose blocks fit in memory_bytes
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if nbytes(counts(mid)) <= memory_bytes else (lo, mid - 1)
        out = counts(lo)
    need = [g.max_blocks_per_seq(max_model_len, block_size, max_num_batched_tokens) for g in groups]
    short = [(g, n, k) for g, n, k in zip(groups, out, need) if n < k]
    if short:
        g, n, k = short[0]
        per_token = sum(x.block_bytes(block_size, dtype) for x in groups) / block_size
        raise ValueError(
            f"the KV cache is too small: {n} blocks of {block_size} tokens in the "
            f"{'full-attention' if g.window is None else f'window-{g.window}'} group, but one sequence of "
            f"max_model_len={max_model_len} tokens needs {k}; give more memory (about {per_token:.0f} bytes "
            f"per token) or a smaller max_model_len")
    return out


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """Chained content hash of one full block: sha256(parent digest || int64 token ids)."""
    h = hashlib.sha256(parent or b"")
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    return h.digest()


class BlockPool:
    """Physical blocks of one KV-cache group: reference counts, free queue, hash -> block.

    Free blocks sit in an LRU queue (released last, evicted last). A free block may still
    hold a cached prefix (its hash is kept until the block is reallocated).
    """

    def __init__(self, num_blocks: int, enable_caching: bool):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, including evictable cached ones)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        """Take the least recently freed block (evicting its cached hash). Caller checks num_free."""
        b, _ = self.free.popitem(last=False)
        h = self.hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.hash[b] = None
        self.ref[b] = 1
        return b

    def touch(self, b: int) -> None:
        """Take one more reference to block ``b`` (a prefix-cache hit)."""
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def release(self, b: int) -> None:
        """Drop one reference to block ``b``; at zero it becomes free (still cached if hashed)."""
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released more often than taken"
        if self.ref[b] == 0:
            self.free[b] = None

    def lookup(self, h: bytes) -> int | None:
        """The block holding the tokens hashed to ``h``, or None (always None with caching off)."""
        return self.cached.get(h) if self.enable_caching else None

    def register(self, b: int, h: bytes) -> None:
        """Record that full block ``b`` holds the tokens hashed to ``h``."""
        if self.enable_caching and self.hash[b] is None and h not in self.cached:
            self.cached[h] = b
            self.hash[b] = h

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        self.cached.clear()
        self.hash = [None] * self.num_blocks


class KVCacheManager:
    """Allocates blocks of every KV-cache group to requests.

    A request (``memra.engine.request.Request``) carries ``block_tables`` (one list per
    group), ``block_hashes`` and ``num_computed_tokens``; this class updates them.

    Args:
        groups: from :func:`kv_groups`.
        num_blocks: blocks per group (from :func:`plan_kv_blocks`).
        block_size: tokens per block.
        enable_prefix_caching: reuse cached full blocks across requests.
    """

    def __init__(self, groups: list[KVGroupSpec], num_blocks: list[int], block_size: int,
                 enable_prefix_caching: bool = True):
        self.groups, self.block_size = groups, block_size
        self.pools = [BlockPool(n, enable_prefix_caching) for n in num_blocks]
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # ----------------------------------------------------------------- sizes
    def check_fits(self, num_tokens: int, max_chunk: int) -> None:
        """Raises KVCapacityError if one sequence of ``num_tokens`` tokens can never fit alone."""
        for g, pool in zip(self.groups, self.pools):
            need = g.max_blocks_per_seq(num_tokens, self.block_size, max_chunk)
            if need > pool.num_blocks:
                raise KVCapacityError(
                    f"a sequence of {num_tokens} tokens needs {need} KV-cache blocks of {self.block_size} tokens, "
                    f"more than the whole cache holds ({pool.num_blocks} blocks)")

    @property
    def num_blocks(self) -> int:
        """Blocks of all groups."""
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests, all groups."""
        return sum(p.num_used for p in self.pools)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return self.num_used_blocks / max(1, self.num_blocks)

    # ---------------------------------------------------------------- hashes
    def _update_hashes(self, req) -> None:
        toks = req.all_token_ids
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= len(toks):
            i = len(req.block_hashes)
            req.block_hashes.append(hash_block(req.block_hashes[-1] if i else None, toks[i * bs:(i + 1) * bs]))

    def _window_first_block(self, g: KVGroupSpec, position: int) -> int:
        """First logical block a query at ``position`` (or later) can still see in group ``g``."""
        if g.window is None:
            return 0
        return max(0, position - g.window + 1) // self.block_size

    # ------------------------------------------------------------ allocation
    def find_prefix(self, req) -> tuple[int, list[list[int]]]:
        """Longest cached prefix usable by a request that has nothing computed.

        Returns ``(num_tokens, tables)``: a multiple of ``block_size`` below the request's
        token count (at least one token is always recomputed, for its logits), and per
        group the block table of that prefix (-1 where a sliding group needs no block).
        Takes no references (see :meth:`allocate`).
        """
        if not self.enable_prefix_caching or req.prompt_logprobs is not None:
            return 0, [[] for _ in self.groups]
        self._update_hashes(req)
        bs = self.block_size
        max_blocks = min(len(req.block_hashes), (req.num_tokens - 1) // bs)
        hits = [[p.lookup(h) for h in req.block_hashes[:max_blocks]] for p in self.pools]
        # full-attention groups need every block of the prefix
        n = max_blocks
        for g, hs in zip(self.groups, hits):
            if g.window is None:
                k = 0
                while k < n and hs[k] is not None:
                    k += 1
                n = k
        # sliding groups need the blocks the first recomputed token can see
        while n > 0:
            ok = all(all(hs[j] is not None for j in range(self._window_first_block(g, n * bs), n))
                     for g, hs in zip(self.groups, hits) if g.window is not None)
            if ok:
                break
            n -= 1
        tables = []
        for g, hs in zip(self.groups, hits):
            lo = self._window_first_block(g, n * bs)
            tables.append([NULL_BLOCK] * lo + hs[lo:n])
        return n * bs, tables

    def allocate(self, req, num_new_tokens: int, prefix: tuple[int, list[list[int]]] | None = None) -> bool:
        """Make room for the next ``num_new_tokens`` tokens of ``req`` in every group.

        ``prefix`` (from :meth:`find_prefix`, only for a request with nothing computed)
        is taken over first. Blocks of sliding groups that no query from
        ``num_computed_tokens`` on can see are released. Returns False, changing
        nothing but those releases, if some group lacks free blocks.
        """
        bs = self.block_size
        if prefix is not None and prefix[0] > 0:
            start = prefix[0]
            tables = prefix[1]
        else:
            start = req.num_computed_tokens
            tables = None
        if not req.block_tables:
            req.block_tables = [[] for _ in self.groups]
        # release what fell out of the sliding windows
        if tables is None:
            for g, pool, table in zip(self.groups, self.pools, req.block_tables):
                if g.window is not None:
                    for j in range(self._window_first_block(g, start)):
                        if table[j] != NULL_BLOCK:
                            pool.release(table[j])
                            table[j] = NULL_BLOCK
        end_blocks = -(-(start + num_new_tokens) // bs)
        for gi, pool in enumerate(self.pools):
            have = len(tables[gi]) if tables is not None else len(req.block_tables[gi])
            need = end_blocks - have
            if tables is not None:  # cached blocks that are free now stop being allocatable
                need += sum(1 for b in tables[gi] if b != NULL_BLOCK and pool.ref[b] == 0)
            if need > pool.num_free:
                return False
        if tables is not None:
            for gi, pool in enumerate(self.pools):
                for b in tables[gi]:
                    if b != NULL_BLOCK:
                        pool.touch(b)
                req.block_tables[gi] = list(tables[gi])
            req.num_computed_tokens = start
        for gi, pool in enumerate(self.pools):
            table = req.block_tables[gi]
            while len(table) < end_blocks:
                table.append(pool.allocate())
        return True

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one prefix-cache lookup of ``num_tokens`` prompt tokens that found ``num_hit``."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def cache_computed(self, req) -> None:
        """Register the request's computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(req)
        n = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for pool, table in zip(self.pools, req.block_tables):
            for j in range(n):
                if table[j] != NULL_BLOCK:
                    pool.register(table[j], req.block_hashes[j])

    def trim(self, req) -> None:
        """Release the blocks past what the request's tokens need (rejected drafts' blocks)."""
        keep = -(-req.num_tokens // self.block_size)
        for pool, table in zip(self.pools, req.block_tables):
            while len(table) > keep:
                b = table.pop()
                if b != NULL_BLOCK:
                    pool.release(b)

    def free(self, req) -> None:
        """Release every block the request holds (last blocks first, so prefixes stay cached longest)."""
        for pool, table in zip(self.pools, req.block_tables):
            for b in reversed(table):
                if b != NULL_BLOCK:
                    pool.release(b)
        req.block_tables = []
        req.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix in every group."""
        for p in self.pools:
            p.reset_prefix_cache()
