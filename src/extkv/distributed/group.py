"""This process's place among the tensor-parallel ranks, and the collectives that cross them.

Two groups: the device group carries the forward pass's all-reduces and
all-gathers (NCCL on CUDA, gloo on the CPU); the control group (gloo, host
memory) carries the driver's small messages, each step's inputs and the
start-up sizes. On the CPU both are one gloo group.

They are torch.distributed backends used directly rather than torch's default
process group: each engine owns its own, so one process can hold several
engines (and a default group of the user's) at once.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend, Work


class CommunicationError(RuntimeError):
    """A collective failed: another rank is gone, or failed itself."""


def _run(collective: Callable[..., Work], *args: object) -> None:
    try:
        collective(*args).wait()
    except RuntimeError as e:
        raise CommunicationError(f"a tensor-parallel collective failed: {e}") from e


@dataclass(eq=False)
class TPGroup:
    """Rank `rank` of `size`; with size 1 every collective returns its input unchanged."""

    rank: int = 0
    size: int = 1
    device_group: Backend | None = None
    control_group: Backend | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            _run(self.device_group.allreduce, [x])
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d) on every rank -> (n, size * d): the ranks' columns side by side."""
        if self.size == 1:
            return x
        out = x.new_empty(self.size * x.shape[0], x.shape[1])
        _run(self.device_group._allgather_base, out, x.contiguous())
        return out.view(self.size, *x.shape).transpose(0, 1).flatten(1)

    def all_gather_ints(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order."""
        if self.size == 1:
            return [value]
        out = torch.empty(self.size, dtype=torch.int64)
        _run(self.control_group._allgather_base, out, torch.tensor([value]))
        return out.tolist()

    def broadcast_object(
        self, obj: object = None, timeout: datetime.timedelta | None = None
    ) -> object:
        """Rank 0's `obj` on every rank (pickled: the ranks are this engine's own
        processes). `timeout` overrides the group's, for a worker that waits idle."""
        size = torch.empty(1, dtype=torch.int64)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size[0] = data.numel()
        self._broadcast(self.control_group, size, timeout)
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(self.control_group, data, timeout)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into `x` on every rank (contiguous, of one shape and dtype on all),
        over the device group: e.g. weights the driver was given, on every device."""
        if self.size > 1:
            self._broadcast(self.device_group, x.view(-1).view(torch.uint8), None)
        return x

    @staticmethod
    def _broadcast(group: Backend, t: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        if timeout is not None:
            opts.timeout = timeout
        _run(group.broadcast, [t], opts)

    def abort(self) -> None:
        """Make a collective that waits on a dead rank fail instead of hanging. Gloo
        notices a closed connection by itself; NCCL does not."""
        if self.device_group is not self.control_group:
            self.device_group.abort()


SINGLE = TPGroup()


def connect(
    store: dist.Store,
    rank: int,
    size: int,
    device: torch.device,
    timeout: datetime.timedelta,
    host: str | None = None,
) -> TPGroup:
    """Join the groups of `size` ranks that meet at `store` (all ranks call this).
    `host`: the address gloo listens on (None: this machine's hostname)."""
    gloo_device = (
        dist.ProcessGroupGloo.create_device(hostname=host)
        if host
        else dist.ProcessGroupGloo.create_default_device()
    )
    options = dist.ProcessGroupGloo._Options()
    options._devices = [gloo_device]
    options._timeout = timeout
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, size, options)
    if device.type != "cuda":
        return TPGroup(rank, size, control, control)
    torch.cuda.set_device(device)
    nccl_options = dist.ProcessGroupNCCL.Options()
    nccl_options._timeout = timeout
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("device/", store), rank, size, nccl_options)
    return TPGroup(rank, size, nccl, control)


_current: TPGroup = SINGLE


def current_group() -> TPGroup:
    """The group that models being built now split their layers over."""
    return _current


@contextmanager
def use_group(group: TPGroup) -> Iterator[None]:
    """Build models for `group`: parallel layers take their shard sizes from it."""
    global _current
    previous, _current = _current, group
    try:
        yield
    finally:
        _current = previous
