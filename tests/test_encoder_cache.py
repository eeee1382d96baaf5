"""The encoder cache's bookkeeping and the scheduler around it, no model: entries by content
hash, held per request image, kept for reuse once released and evicted oldest first; a
prompt chunk stops before an image that does not fit, a request whose first chunk would be
empty waits, images are released once prefilled past, on preemption and on abort. Random
runs never plan a step whose images the device would not have, never put a prompt that
waits for its next chunk into a decode step, never go over the budget, and end with
nothing held."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extkv.engine.block_manager import BlockManager
from extkv.engine.encoder_cache import EncoderCacheManager
from extkv.engine.multimodal import ImageInput
from extkv.engine.sampling_params import SamplingParams
from extkv.engine.scheduler import Scheduler
from extkv.engine.sequence import Sequence, SequenceStatus
from extkv.engine.step_plan import StepPlan
from helpers import kv_groups

IMAGE = 99  # the placeholder token
RUN = 8  # embeddings per image
BLOCK_SIZE = 4


def test_entries_are_shared_released_and_evicted_oldest_first() -> None:
    cache = EncoderCacheManager(3 * RUN)
    assert not cache.acquire("a")  # not there: a miss to compute
    cache.allocate("a", RUN)
    assert cache.acquire("a")  # a second holder
    cache.allocate("b", RUN)
    cache.allocate("c", RUN)
    assert not cache.can_allocate(1)  # all held
    for name in ("a", "a", "c", "b"):  # released: a first, then c, then b
        cache.release(name)
    assert cache.num_held_tokens == 0 and cache.num_entries == 3
    assert cache.can_allocate(3 * RUN) and not cache.can_allocate(2 * RUN, acquiring={"a", "c"})
    cache.allocate("d", 2 * RUN)  # evicts a, then c
    assert cache.take_evicted() == ["a", "c"] and cache.take_evicted() == []
    assert cache.acquire("b")  # kept for reuse: a hit
    assert (cache.num_hits, cache.num_misses) == (2, 4)
    with pytest.raises(RuntimeError, match="no room"):
        cache.allocate("e", RUN)
    cache.forget(["d", "missing"])  # its step failed: gone, held or not
    assert cache.take_evicted() == ["d"] and not cache.has("d")
    assert cache.num_used_tokens == RUN


def image(name: str, offset: int) -> ImageInput:
    return ImageInput(name, torch.zeros(0), offset, RUN)


def sequence(request_id: str, layout: str, max_tokens: int = 2) -> Sequence:
    """A prompt from `layout`: a lowercase letter is a text token, an uppercase one an
    image (RUN placeholders) whose content is that letter."""
    tokens: list[int] = []
    images: list[ImageInput] = []
    for char in layout:
        if char.isupper():
            images.append(image(char, len(tokens)))
            tokens += [IMAGE] * RUN
        else:
            tokens.append(ord(char))
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens), None, tuple(images))


def make_scheduler(
    encoder_tokens: int = RUN,
    max_num_batched_tokens: int = 64,
    num_blocks: int = 64,
    max_num_seqs: int = 4,
) -> Scheduler:
    blocks = BlockManager(num_blocks, kv_groups(BLOCK_SIZE))
    cache = EncoderCacheManager(encoder_tokens)
    return Scheduler(blocks, max_num_seqs, max_num_batched_tokens, 64, frozenset({0}), cache)


class Device:
    """What the runner's encoder cache holds, as the plans tell it."""

    def __init__(self) -> None:
        self.entries: set[str] = set()

    def run(self, scheduler: Scheduler) -> StepPlan | None:
        """Plan a step, check the device has every image it reads, launch it and give each
        sampled request a token."""
        plan = scheduler.schedule()
        if plan is None:
            return None
        self.entries -= set(plan.evicted_encoder_hashes)
        assert not {i.hash for i in plan.encoder_inputs} & self.entries  # computed once
        self.entries |= {i.hash for i in plan.encoder_inputs}
        for request in plan.requests:
            assert {i.hash for i in request.images} <= self.entries
            # A decode step's rows are sequences at their prompt's last token or past it,
            # never one with prompt tokens still to compute before the one it would sample.
            seq = scheduler._requests[request.request_id]
            assert plan.is_prefill or seq.num_uncomputed_tokens <= 1
        cache = scheduler.encoder_cache
        assert cache.num_used_tokens <= cache.num_tokens
        assert self.entries == {h for h in self.entries if cache.has(h)}
        scheduler.launched(plan)
        sampled = [r.request_id for r in plan.sampled]
        scheduler.update(sampled, [5] * len(sampled))
        return plan


def test_a_chunk_stops_before_an_image_that_does_not_fit() -> None:
    """One image's room: the chunk takes the text and image A, stops before B, which the
    next step encodes once A is released."""
    scheduler = make_scheduler()
    seq = sequence("0", "abAcdBe")
    scheduler.add(seq)
    device = Device()
    first = device.run(scheduler)
    assert first.num_tokens == 2 + RUN + 2 and [i.hash for i in first.encoder_inputs] == ["A"]
    assert [i.hash for i in first.requests[0].images] == ["A"]
    assert seq.encoder_held == set()  # prefilled past A: released
    second = device.run(scheduler)
    assert [i.hash for i in second.encoder_inputs] == ["B"] and second.evicted_encoder_hashes == [
        "A"
    ]
    assert second.requests[0].num_computed_tokens == first.num_tokens


def test_an_image_straddling_chunks_is_encoded_once() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=3)
    seq = sequence("0", "aAb")
    scheduler.add(seq)
    device = Device()
    plans = [device.run(scheduler) for _ in range(4)]
    assert [p.num_tokens for p in plans] == [3, 3, 3, 1]
    assert [[i.hash for i in p.encoder_inputs] for p in plans] == [["A"], [], [], []]
    assert [[i.hash for i in p.requests[0].images] for p in plans] == [["A"], ["A"], ["A"], []]
    assert scheduler.encoder_cache.num_misses == 1


def test_a_request_waits_while_the_room_is_held() -> None:
    """The budget is one image: while the first prompt holds A across two chunks, the
    second (whose first chunk would need B) waits; it gets B's room once A is released,
    evicting A, which the third then computes again."""
    scheduler = make_scheduler(max_num_batched_tokens=5)
    for request_id, layout in (("0", "aA"), ("1", "B"), ("2", "xA")):
        scheduler.add(sequence(request_id, layout))
    device = Device()
    for _ in range(2):  # the first prompt's two chunks, with room for the second's first
        plan = device.run(scheduler)
        assert [r.request_id for r in plan.requests] == ["0"]
        assert [s.request_id for s in scheduler.waiting] == ["1", "2"]
    plan = device.run(scheduler)
    assert [r.request_id for r in plan.requests] == ["1"]
    assert plan.evicted_encoder_hashes == ["A"] and [i.hash for i in plan.encoder_inputs] == ["B"]
    scheduler.abort("1")  # B released
    plan = device.run(scheduler)
    assert [r.request_id for r in plan.requests] == ["2"]  # a prefill step (decodes wait)
    assert [i.hash for i in plan.encoder_inputs] == ["A"]  # evicted before: computed again
    assert scheduler.encoder_cache.num_misses == 3


def test_identical_images_in_flight_share_one_entry() -> None:
    scheduler = make_scheduler(encoder_tokens=2 * RUN)
    for request_id, layout in (("0", "aA"), ("1", "A"), ("2", "bAcA")):
        scheduler.add(sequence(request_id, layout))
    plan = Device().run(scheduler)
    assert [r.request_id for r in plan.requests] == ["0", "1", "2"]
    assert [i.hash for i in plan.encoder_inputs] == ["A"]
    cache = scheduler.encoder_cache
    assert (cache.num_misses, cache.num_hits, cache.num_entries) == (1, 3, 1)


def test_preemption_releases_the_images_and_recomputes_them() -> None:
    """Blocks for one prompt only: the second is preempted mid-image and releases it."""
    scheduler = make_scheduler(encoder_tokens=2 * RUN, max_num_batched_tokens=6, num_blocks=6)
    seqs = [sequence("0", "aAcdefgh", max_tokens=8), sequence("1", "bB", max_tokens=8)]
    for seq in seqs:
        scheduler.add(seq)
    device = Device()
    while scheduler.has_unfinished():
        device.run(scheduler)
        for seq in seqs:
            if seq.status == SequenceStatus.WAITING:
                assert not seq.encoder_held
    assert seqs[1].num_preemptions > 0
    assert scheduler.encoder_cache.num_held_tokens == 0
    assert scheduler.block_manager.num_used_blocks == 0


LAYOUTS = st.text(alphabet="abcABC", min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    layouts=st.lists(LAYOUTS, min_size=1, max_size=5),
    images_room=st.integers(1, 3),
    step_tokens=st.integers(2, 20),
    num_blocks=st.integers(13, 40),  # one prompt of 3 images and its tokens: 13 blocks
    aborts=st.lists(st.integers(0, 30), max_size=3),
)
# Found by the decode-rows check: "aAB" waits mid-prompt for B's room while "A" decodes, and
# the decode step took "aAB" in too, as if its next prompt token were a decode.
@example(layouts=["aAB", "A"], images_room=1, step_tokens=2, num_blocks=13, aborts=[])
# Without that, "AAABA" waited for A's room, held by "AAB", which waited for the blocks
# "AAABA" held: nothing ran again until the youngest was preempted.
@example(layouts=["AAABA", "AAB"], images_room=1, step_tokens=5, num_blocks=13, aborts=[])
# "AAA" lacked blocks, preempted "AB" for them, still lacked them, and "AB" was admitted
# again in the same step to take them back: every step, for good (before this session).
@example(layouts=["AAA", "AAA", "AB"], images_room=1, step_tokens=13, num_blocks=13, aborts=[])
def test_random_runs_never_miss_an_image_and_end_with_nothing_held(
    layouts: list[str], images_room: int, step_tokens: int, num_blocks: int, aborts: list[int]
) -> None:
    scheduler = make_scheduler(images_room * RUN, max(step_tokens, 4), num_blocks)
    seqs = [sequence(str(i), layout, max_tokens=3) for i, layout in enumerate(layouts)]
    for seq in seqs:
        scheduler.add(seq)
    device = Device()
    for step in range(1000):  # a bound, so a livelock fails instead of hanging
        if not scheduler.has_unfinished():
            break
        if step in aborts:
            scheduler.abort(seqs[step % len(seqs)].request_id)
        device.run(scheduler)
    assert not scheduler.has_unfinished(), "requests left after 1000 steps"
    assert scheduler.encoder_cache.num_held_tokens == 0
    assert scheduler.block_manager.num_used_blocks == 0
    assert all(not seq.encoder_held for seq in seqs)
