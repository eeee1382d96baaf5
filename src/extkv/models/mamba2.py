"""The Mamba2 mixer: a state-space layer whose per-sequence state lives in cache blocks.

Where an attention layer keeps K/V for every past token, a Mamba2 mixer keeps
two fixed-size states per sequence: the last `conv_kernel - 1` inputs of its
causal conv and the SSM state. The engine binds both to block-major views of
the KV cache; each step reads and writes the rows `state_indices` names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from extkv.attention import MambaMetadata, get_forward_context
from extkv.distributed import current_group
from extkv.models import ops
from extkv.models.mamba2_ops import causal_conv_varlen, ssd_varlen, ssm_step, time_step
from extkv.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    sharded,
    split_evenly,
    stacked,
)


@dataclass(frozen=True)
class Mamba2Dims:
    """A mixer's shape, whatever a model family's config calls each field."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    eps: float
    use_bias: bool
    use_conv_bias: bool
    time_step_limit: tuple[float, float]

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of n_groups")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {self.conv_kernel}")

    def split(self, num_ranks: int) -> Mamba2Dims:
        """One rank's share: 1/num_ranks of the heads and of the groups (divisibility
        checked by the caller), each head still reading B and C of its own group."""
        return dataclasses.replace(
            self, num_heads=self.num_heads // num_ranks, n_groups=self.n_groups // num_ranks
        )

    @property
    def intermediate_size(self) -> int:
        """Width of x, of the gate and of the SSM output: all heads side by side."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size


def check_activation(name: str) -> None:
    """Refuse an activation but SiLU (`swish` is its other name): the mixer's ops apply SiLU."""
    if name not in ("silu", "swish"):
        raise ValueError(f"Mamba2 activation {name!r} is not supported; only 'silu'")


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(gate) within each of `n_groups` channel groups (HF's
    `MambaRMSNormGated`): groups are normalised apart, as the model was trained."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y (T, dim), any dtype; gate (T, dim) in the model dtype, which the result takes."""
        return ops.gated_rms_norm(y, gate, self.weight, self.group_size, self.eps)


class Mamba2Mixer(nn.Module):
    """Mamba2 over flat token batches, reading and writing per-sequence states.

    States, one row per cache block (see `state_shapes` / `state_dtypes`):
    `ssm_state` (num_blocks, H, P, N) and `conv_state` (num_blocks, conv_dim,
    conv_kernel - 1), views of any row stride that the engine binds. Unbound
    (empty, the profiling run) the mixer starts every sequence from zeros and
    keeps nothing. Bound, sequence `s` reads row `state_indices[s]` when
    `has_initial_state[s]` (zeros otherwise) and writes its final states
    there; a negative index is a padding row, read as zeros and never written.
    """

    def __init__(self, dims: Mamba2Dims, ssm_state_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # Tensor parallel: each rank holds whole heads and whole groups; every
        # projection and per-channel parameter keeps this rank's rows of them.
        heads = split_evenly(dims.num_heads, "the Mamba heads (num_heads)")
        inner = split_evenly(dims.num_heads, "the Mamba heads (num_heads)", dims.head_dim)
        bc = split_evenly(dims.n_groups, "the Mamba groups (n_groups)", dims.state_size)
        xbc = stacked([inner, bc, bc])
        self.dims = d = dims.split(current_group().size)
        self.ssm_state_dtype = ssm_state_dtype
        self.in_proj = ColumnParallelLinear(
            d.hidden_size, {None: stacked([inner, inner, bc, bc, heads])}, d.use_bias
        )
        self.conv1d = nn.Conv1d(
            d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=d.use_conv_bias
        )
        for param in self.conv1d.parameters():
            sharded(param, *xbc)
        self.dt_bias = sharded(nn.Parameter(torch.zeros(d.num_heads)), heads)
        self.A_log = sharded(nn.Parameter(torch.zeros(d.num_heads)), heads)
        self.D = sharded(nn.Parameter(torch.ones(d.num_heads)), heads)
        self.norm = GatedRMSNorm(d.intermediate_size, d.intermediate_size // d.n_groups, d.eps)
        sharded(self.norm.weight, inner)
        self.out_proj = RowParallelLinear(inner, d.hidden_size, d.use_bias)
        self.ssm_state = torch.empty(0)
        self.conv_state = torch.empty(0)
        self.state_group = 0  # which row of the step's state_indices is this layer's

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-block shapes of (ssm_state, conv_state); fp32 first keeps both aligned."""
        d = self.dims
        return (d.num_heads, d.head_dim, d.state_size), (d.conv_dim, d.conv_kernel - 1)

    def state_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(ssm_state, conv_state): the SSM state in fp32 as HF keeps it (it accumulates
        over the whole sequence), the conv state in the model dtype (it holds inputs)."""
        return self.ssm_state_dtype, self.in_proj.weight.dtype

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (T, hidden_size) -> (the mixer of `norm(hidden, residual)`, the residual
        stream): the norm runs fused into in_proj where a decode step's GEMV runs."""
        d = self.dims
        metadata = get_forward_context().mamba
        projected, residual = self.in_proj.normed(hidden, residual, norm)
        gate, xBC, dt = projected.split([d.intermediate_size, d.conv_dim, d.num_heads], dim=-1)
        if not hidden.is_cuda:
            y = self._forward_torch(xBC, dt, metadata)
        elif metadata.is_prefill:
            y = self._prefill_triton(xBC, dt, metadata)
        elif self._bound(metadata):
            y = self._decode_triton(xBC, dt, metadata)
        else:
            y = self._forward_torch(xBC, dt, metadata)
        return self.out_proj(self.norm(y.flatten(1), gate)), residual

    def _state_indices(self, metadata: MambaMetadata) -> torch.Tensor:
        """This layer's state rows: hybrid models cut Mamba layers into groups (see
        extkv.kv_cache.plan), each with its own state block per sequence."""
        return metadata.state_indices[self.state_group]

    def _bound(self, metadata: MambaMetadata) -> bool:
        if self.ssm_state.numel() == 0:
            return False
        if metadata.state_indices is None or metadata.has_initial_state is None:
            raise RuntimeError(
                "Mamba2 states are bound but the step has no state_indices / has_initial_state"
            )
        return True

    def _split_conv_out(self, xBC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output (T, conv_dim) -> x (T, H, P), B and C (T, G, N)."""
        d = self.dims
        x, B, C = xBC.split([d.intermediate_size, *2 * [d.n_groups * d.state_size]], dim=-1)
        return (
            x.unflatten(-1, (d.num_heads, d.head_dim)),
            B.unflatten(-1, (d.n_groups, d.state_size)),
            C.unflatten(-1, (d.n_groups, d.state_size)),
        )

    def _forward_torch(
        self, xBC: torch.Tensor, dt: torch.Tensor, metadata: MambaMetadata
    ) -> torch.Tensor:
        """The CPU's steps, and a CUDA decode without bound states. Returns y (T, H, P)
        in fp32."""
        bound = self._bound(metadata)
        ssm_init, conv_init = self._initial_states(metadata, bound, xBC.dtype)
        conv_out, conv_final = causal_conv_varlen(
            xBC, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_init, metadata.cu_seqlens_q
        )
        x, B, C = self._split_conv_out(conv_out)
        dt = time_step(dt, self.dt_bias, self.dims.time_step_limit)
        A = -torch.exp(self.A_log.float())
        if metadata.is_prefill:
            y, ssm_final = ssd_varlen(
                x, dt, A, B, C, self.D, ssm_init, metadata.host_cu_seqlens, self.dims.chunk_size
            )
        else:
            y, ssm_final = ssm_step(ssm_init, x, dt, A, B, C, self.D)
        if bound:
            indices = self._state_indices(metadata)
            keep = indices >= 0
            rows = indices[keep].long()
            self.ssm_state[rows] = ssm_final[keep].to(self.ssm_state.dtype)
            self.conv_state[rows] = conv_final[keep].to(self.conv_state.dtype)
        return y

    def _initial_states(
        self, metadata: MambaMetadata, bound: bool, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's (ssm, conv) state to continue from: its row, or zeros."""
        ssm_shape, conv_shape = self.state_shapes()
        num_seqs, device = metadata.num_seqs, metadata.cu_seqlens_q.device
        if not bound:
            return (
                torch.zeros(num_seqs, *ssm_shape, device=device),
                torch.zeros(num_seqs, *conv_shape, dtype=dtype, device=device),
            )
        indices = self._state_indices(metadata)
        carry = (metadata.has_initial_state & (indices >= 0)).view(-1, 1, 1)
        rows = indices.clamp(min=0).long()
        ssm = torch.where(carry[..., None], self.ssm_state[rows].float(), 0.0)
        conv = torch.where(carry, self.conv_state[rows].to(dtype), 0.0)
        return ssm, conv

    def _prefill_triton(
        self, xBC: torch.Tensor, dt: torch.Tensor, metadata: MambaMetadata
    ) -> torch.Tensor:
        """A prefill on the GPU: the conv and the chunked scan in Triton kernels that read
        each sequence's states from its cache rows and write them back (none when the
        states are unbound: the profiling run). Returns y (T, H, P) in fp32."""
        from extkv.kernels.causal_conv import causal_conv_prefill
        from extkv.kernels.ssd_prefill import chunk_layout, ssd_prefill

        chunk = self.dims.chunk_size
        if chunk not in metadata.chunk_layouts:  # the step's first Mamba layer builds it
            layout = chunk_layout(metadata.host_cu_seqlens, chunk, xBC.device)
            metadata.chunk_layouts[chunk] = layout
        layout = metadata.chunk_layouts[chunk]
        rows = ()  # the states' rows and whether each carries over; none unbound
        if self._bound(metadata):
            rows = (self._state_indices(metadata), metadata.has_initial_state)
        conv_state = (self.conv_state, *rows) if rows else ()
        weight = self.conv1d.weight.squeeze(1)
        conv_out = causal_conv_prefill(
            xBC, weight, self.conv1d.bias, layout, metadata.cu_seqlens_q, *conv_state
        )
        x, B, C = self._split_conv_out(conv_out)
        dt = time_step(dt, self.dt_bias, self.dims.time_step_limit)
        A = -torch.exp(self.A_log.float())
        ssm_state = (self.ssm_state, *rows) if rows else ()
        return ssd_prefill(x, dt, A, B, C, self.D, layout, *ssm_state)

    def _decode_triton(
        self, xBC: torch.Tensor, dt: torch.Tensor, metadata: MambaMetadata
    ) -> torch.Tensor:
        """One token per sequence on the GPU: two kernels that update the states in
        place, no host syncs (CUDA-graph capturable). Returns y (S, H, P) in fp32."""
        from extkv.kernels.causal_conv import causal_conv_update
        from extkv.kernels.ssd_update import ssm_state_update

        indices, carry = self._state_indices(metadata), metadata.has_initial_state
        conv_out = causal_conv_update(
            xBC, self.conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, indices, carry
        )
        x, B, C = self._split_conv_out(conv_out)
        return ssm_state_update(
            self.ssm_state,
            x,
            dt,
            self.dt_bias,
            self.A_log,
            B,
            C,
            self.D,
            indices,
            carry,
            self.dims.time_step_limit,
        )
