"""Prefix reuse across requests for a hybrid KDA + MLA model.

An MLA layer's cache is per token, so any cached prefix can be cut at any page boundary. A KDA
layer's is one fixed-size state that is updated in place and cannot be split or added up: it can
only be restored at a point where it was saved. So:
  - prompts are cut into pages of ``page_tokens`` tokens, each named by a hash chained over every
    token before it (the same page text after a different prefix is a different page);
  - every cached page keeps its MLA latents (all MLA layers), in a pool that grows a block of
    ``block_pages`` pages at a time;
  - the KDA states (and conv rings) are kept only every ``state_every`` pages;
  - a request restores the MLA pages and the KDA states at the last boundary that has both, and
    replays the tokens after it (which also rewrites those tokens' MLA latents, identically).
The least recently used pages are evicted when ``max_pages`` is reached (their state checkpoints
with them). One request at a time, batch 1.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3 import decode

_MLA_KEYS = ("c_kv", "k_rope")


def _is_mla(path) -> bool:
    return getattr(path[-1], "key", None) in _MLA_KEYS


def page_hashes(tokens: Sequence[int], page_tokens: int) -> list[str]:
    """Chained hashes of the full pages of ``tokens``: page i's hash covers tokens[: (i+1) * page]."""
    out, h = [], b""
    for i in range(len(tokens) // page_tokens):
        page = np.asarray(tokens[i * page_tokens:(i + 1) * page_tokens], np.int64).tobytes()
        h = hashlib.blake2b(h + page, digest_size=16).digest()
        out.append(h.hex())
    return out


class PrefixCache:
    """Cached prefixes of earlier requests for one model; see the module docstring.

    ``prefill(tokens)`` returns the last position's logits [V] and a decode cache of capacity
    ``max_len`` holding ``tokens`` (use it with `k3.decode.extend` afterwards), reusing what it can
    and storing what it computed. ``stats`` counts hits, replayed and computed tokens.
    """

    def __init__(self, model, *, max_len: int, page_tokens: int = 512, state_every: int = 4,
                 block_pages: int = 16, max_pages: int = 4096):
        if page_tokens <= 0 or state_every <= 0 or block_pages <= 0:
            raise ValueError("page_tokens, state_every and block_pages must be > 0")
        self.model, self.max_len = model, max_len
        self.page, self.state_every, self.block_pages, self.max_pages = page_tokens, state_every, block_pages, max_pages
        self.segment = page_tokens * state_every  # prefill runs in segments between state checkpoints
        template = jax.eval_shape(lambda: decode.init_cache(model, 1, max_len))
        leaves = jax.tree_util.tree_flatten_with_path(template)[0]
        self._treedef = jax.tree.structure(template)
        self._mla = [i for i, (path, _) in enumerate(leaves) if _is_mla(path)]
        self._kda = [i for i, (path, _) in enumerate(leaves)
                     if not _is_mla(path) and getattr(path[-1], "key", None) != "length"]
        self._leaf_shapes = [x.shape for _, x in leaves]
        self._leaf_dtypes = [x.dtype for _, x in leaves]
        self._blocks: list[list[np.ndarray]] = []  # per block: one array per MLA leaf [block_pages, ...]
        self._free: list[tuple[int, int]] = []
        self._pages: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()  # LRU order
        self._states: dict[str, list[np.ndarray]] = {}  # page hash at a checkpoint -> KDA leaves
        self.stats = collections.Counter()
        self._extend = jax.jit(lambda t, c, n: decode.extend(model, t, c, n))

    # -- storage ----------------------------------------------------------------------------------

    def _page_slice(self, shape):
        """Shape of one MLA leaf's page: the leaf [..., 1, S, d] with S -> page_tokens and batch dropped."""
        return shape[:-3] + (self.page, shape[-1])

    def _alloc(self) -> tuple[int, int]:
        if not self._free:
            if len(self._blocks) * self.block_pages < self.max_pages:
                b = len(self._blocks)
                self._blocks.append([np.zeros((self.block_pages,) + self._page_slice(self._leaf_shapes[i]),
                                              self._leaf_dtypes[i]) for i in self._mla])
                self._free = [(b, s) for s in range(self.block_pages)][::-1]
            else:  # evict the least recently used page (and its state checkpoint)
                h, slot = self._pages.popitem(last=False)
                self._states.pop(h, None)
                self.stats["evicted_pages"] += 1
                return slot
        return self._free.pop()

    def _store_page(self, h: str, leaves: list, p: int) -> None:
        if h in self._pages:
            self._pages.move_to_end(h)
            return
        b, s = self._alloc()
        lo = p * self.page
        for j, i in enumerate(self._mla):
            self._blocks[b][j][s] = np.asarray(leaves[i][..., 0, lo:lo + self.page, :])
        self._pages[h] = (b, s)

    # -- requests ---------------------------------------------------------------------------------

    def _restore(self, hashes: list[str]) -> tuple[dict, int]:
        """The cache at the longest cached prefix that ends on a state checkpoint, and its length."""
        n = 0
        while n < len(hashes) and hashes[n] in self._pages:
            n += 1
        k = n
        while k > 0 and not (k % self.state_every == 0 and hashes[k - 1] in self._states):
            k -= 1
        if k == 0:
            return decode.init_cache(self.model, 1, self.max_len), 0
        leaves = [np.zeros(s, d) for s, d in zip(self._leaf_shapes, self._leaf_dtypes)]
        for p in range(k):
            b, s = self._pages[hashes[p]]
            self._pages.move_to_end(hashes[p])
            lo = p * self.page
            for j, i in enumerate(self._mla):
                leaves[i][..., 0, lo:lo + self.page, :] = self._blocks[b][j][s]
        for i, x in zip(self._kda, self._states[hashes[k - 1]]):
            leaves[i] = x
        length_idx = next(i for i in range(len(leaves)) if i not in self._mla and i not in self._kda)
        leaves[length_idx] = np.full((1,), k * self.page, np.int32)
        self.stats["hit_pages"] += k
        return jax.tree.unflatten(self._treedef, [jnp.asarray(x) for x in leaves]), k * self.page

    def prefill(self, tokens: Sequence[int]):
        """(logits [V] fp32 after the last token, decode cache holding ``tokens``)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if len(tokens) > self.max_len:
            raise ValueError(f"{len(tokens)} tokens exceed the cache capacity max_len={self.max_len}")
        hashes = page_hashes(tokens, self.page)
        # Restore at most len - 1 tokens: the last one must run to give the next token's logits.
        cache, pos = self._restore(hashes[:(len(tokens) - 1) // self.page])
        self.stats["requests"] += 1
        self.stats["reused_tokens"] += pos
        logits = None
        while pos < len(tokens):
            # Segments end on state checkpoints, so the state there can be saved; one padded shape.
            end = min(len(tokens), (pos // self.segment + 1) * self.segment)
            seg = np.zeros((1, self.segment), np.int32)
            seg[0, :end - pos] = tokens[pos:end]
            out, cache = self._extend(jnp.asarray(seg), cache, jnp.asarray([end - pos], jnp.int32))
            logits = out[0, end - pos - 1]
            self.stats["computed_tokens"] += end - pos
            leaves = jax.tree.leaves(cache)
            for p in range(pos // self.page, end // self.page):
                self._store_page(hashes[p], leaves, p)
            if end % self.segment == 0:
                self._states[hashes[end // self.page - 1]] = [np.asarray(leaves[i]) for i in self._kda]
            pos = end
        return logits, cache
