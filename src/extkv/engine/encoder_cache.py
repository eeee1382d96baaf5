"""The encoder cache's bookkeeping: which images' embeddings the device holds, and room.

An image's embeddings are computed once, when the first prompt chunk that covers one of
its placeholder positions is scheduled, and kept until every request using them has
prefilled past its run; chunks after the first (a run may straddle a chunk boundary)
read them from the cache. The budget is counted in embeddings (one per placeholder
position): at least one image and one step's tokens, as in vLLM, so any image fits once
the others are gone. Entries are keyed by the image's content hash, so identical images
share one whoever sends them; an entry no request holds any more stays until its room is
needed (least recently released first), and a later request with the same image reuses
it: a hit, where computing it is a miss.

This side only decides; the model runner holds the tensors, computing what a step plan
lists as `encoder_inputs` and dropping what it lists as evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from extkv.models import ImageSpec


def encoder_budget(max_num_batched_tokens: int, spec: ImageSpec) -> int:
    """Embeddings the cache holds, which is also the most one step encodes: a step's
    tokens, and at least one image."""
    return max(max_num_batched_tokens, spec.num_tokens)


class EncoderCacheManager:
    """Entries by content hash with their size in embeddings and how many (request, image)
    pairs hold them; room for new ones, evicting unheld entries as needed."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self._sizes: dict[str, int] = {}  # every entry the device holds
        self._refs: dict[str, int] = {}
        # No request holds them: evictable, oldest first (an OrderedDict: evicting from a
        # dict's front leaves entries every later eviction steps over, see BlockManager).
        self._unheld: OrderedDict[str, None] = OrderedDict()
        self.num_used_tokens = 0  # embeddings of every entry, held or not
        self.num_hits = 0
        self.num_misses = 0
        self._evicted: list[str] = []  # since the last `take_evicted`

    @property
    def num_entries(self) -> int:
        """Entries the device holds now, held by a request or kept for reuse."""
        return len(self._sizes)

    @property
    def num_held_tokens(self) -> int:
        """Embeddings of the entries some request holds now."""
        return self.num_used_tokens - sum(self._sizes[h] for h in self._unheld)

    def acquire(self, hash_: str) -> bool:
        """Hold the entry `hash_` if the cache has it (a hit); False if it must be computed."""
        if hash_ not in self._sizes:
            return False
        self._refs[hash_] += 1
        self._unheld.pop(hash_, None)
        self.num_hits += 1
        return True

    def has(self, hash_: str) -> bool:
        """Whether the cache has the entry `hash_` (held or not)."""
        return hash_ in self._sizes

    def can_allocate(self, num_tokens: int, acquiring: Set[str] = frozenset()) -> bool:
        """Whether new entries of `num_tokens` embeddings in all fit, once unheld entries are
        evicted, but for those `acquiring` (about to be held again)."""
        free = self.num_tokens - self.num_used_tokens
        evictable = sum(self._sizes[h] for h in self._unheld if h not in acquiring)
        return free + evictable >= num_tokens

    def allocate(self, hash_: str, num_tokens: int) -> None:
        """Make the entry `hash_` (a miss: the step computes it), held once, evicting the
        least recently released unheld entries for its room."""
        while self.num_tokens - self.num_used_tokens < num_tokens:
            if not self._unheld:
                raise RuntimeError(
                    f"no room for {num_tokens} embeddings in the encoder cache (can_allocate first)"
                )
            self._evict(next(iter(self._unheld)))
        self._sizes[hash_] = num_tokens
        self._refs[hash_] = 1
        self.num_used_tokens += num_tokens
        self.num_misses += 1

    def release(self, hash_: str) -> None:
        """Drop one hold on `hash_`; an entry nobody holds stays for reuse until evicted."""
        self._refs[hash_] -= 1
        if self._refs[hash_] == 0:
            self._unheld[hash_] = None

    def forget(self, hashes: list[str]) -> None:
        """Drop entries whose step failed, held or not (the failed requests' holds went
        with them): a later request computes them again."""
        for hash_ in hashes:
            if hash_ in self._sizes:
                self._unheld[hash_] = None
                self._evict(hash_)

    def take_evicted(self) -> list[str]:
        """The entries evicted since the last call: the runner frees their tensors."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict(self, hash_: str) -> None:
        del self._unheld[hash_]
        del self._refs[hash_]
        self.num_used_tokens -= self._sizes.pop(hash_)
        self._evicted.append(hash_)
