"""A request as the scheduler sees it: its tokens, its blocks, how far it got."""

from __future__ import annotations

import enum

from extkv.engine.multimodal import ImageInput
from extkv.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Which scheduler queue a sequence is in, or that it is done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One generation request. `num_computed_tokens` of its tokens have their KV in
    the cache; after a preemption it drops to 0 and the prefix is recomputed.

    With asynchronous scheduling the host plans a step before the previous one has
    finished: the `num_pending` tokens sampled on the device but not yet seen by the
    host count in `len(seq)` (they have positions and slots) but are not in
    `token_ids` yet."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        leader: Sequence | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.num_preemptions = 0
        # One block table per KV cache group (see extkv.kv_cache.groups), once it holds
        # blocks: an attention group's in token order (NO_BLOCK: released, out of its
        # window), a recurrent group's the one block its state lives in.
        self.block_tables: list[list[int]] = []
        self.num_released_blocks: list[int] = []  # per group: leading entries released
        self.table_row = -1  # its row of the block manager's HostBlockTables, while it holds blocks
        self.block_hashes: list[int] = []  # prefix caching: content chain of full blocks
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it
        # Of a request with n > 1: its first completion, whose prompt this one waits for
        # (then it takes the prompt's blocks from the prefix cache); None for the first.
        self.leader = leader
        self.images = images  # in prompt order; their placeholder runs are in the prompt
        self.encoder_held: set[int] = set()  # indices of the images it holds in the encoder cache
        # Set by Scheduler.add from the parameters and the model's limits, once, since the
        # scheduler asks them every step: the length that ends it (max_tokens or
        # max_model_len), the tokens that end it (EOS unless ignored, stop_token_ids), and
        # whether a decode step needs only its token (no penalties, no min_tokens).
        self.max_length = 0
        self.end_ids: frozenset[int] = frozenset()
        self.plain_decode = True

    def __len__(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's tokens; they stay the first `num_prompt_tokens` of `token_ids`."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far that the host has seen (not the pending ones)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet, pending ones included: 1 means a decode."""
        # len(self) less the computed ones, without calling __len__: the scheduler asks
        # every running sequence every step.
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    def images_in(self, start: int, end: int) -> tuple[ImageInput, ...]:
        """The images whose placeholder runs overlap positions [start, end)."""
        if not self.images:
            return ()
        return tuple(i for i in self.images if i.offset < end and i.end > start)
