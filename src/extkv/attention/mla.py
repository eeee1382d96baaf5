"""Multi-head latent attention (DeepSeek V2/V3) over a paged cache of latents.

Per token the cache holds one row of `kv_lora_rank + qk_rope_head_dim` values: the
compressed KV latent (after kv_a_layernorm) and the rotary key shared by all heads
(after rope), not K and V per head (the `mla` layout, one "head").

Prefill up-projects each sequence's latents to K and V per head through kv_b_proj, as
transformers does, and attends with memory linear in the prompt. Decode absorbs
kv_b_proj instead, so it reads only the latents: the no-rope query is folded through
its K part (`q_nope @ W_UK`) and scores are taken against the latent rows directly, as
multi-query attention with one KV head whose key is the whole row; the attention over
the latents is lifted to each head's value by W_UV afterwards.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from extkv.attention.metadata import AttentionMetadata, get_forward_context
from extkv.attention.ops import paged_attention, store_latent, varlen_attention
from extkv.attention.reference import causal_attention, gather_context


def _same_head_dim(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v zero-padded to one head size (v_head_dim differs from the q/k head size):
    the attention kernels, the CPU's flash one among them, need one. Zero channels change
    no score and add only zero outputs, which the caller cuts off."""
    dim = max(q.shape[-1], v.shape[-1])
    return tuple(F.pad(t, (0, dim - t.shape[-1])) for t in (q, k, v))


class MLAAttention(nn.Module):
    """Causal MLA over the paged latent cache of one layer.

    `k_cache` and `v_cache` are both the layer's latent cache, (num_blocks, block_size,
    1, kv_lora_rank + qk_rope_head_dim) views bound by the model runner; before binding
    (the profiling run) attention runs on the step's own latents.
    """

    # What the KV cache plan reads: one latent row per token (an MLASpec page).
    latent_cache: ClassVar[bool] = True
    num_kv_heads: ClassVar[int] = 1

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        kv_lora_rank: int,
        v_head_dim: int,
        scale: float,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.v_head_dim = v_head_dim
        self.head_dim = kv_lora_rank + qk_rope_head_dim  # one cache row
        self.scale = scale
        self.kv_group = 0  # the step's attention metadata this layer reads (its KV cache group)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, query: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor
    ) -> torch.Tensor:
        """query (T, H, qk_nope + qk_rope) rotated; latent (T, kv_lora_rank + qk_rope), the
        normed latent then the rotated key; kv_b_weight (H * (qk_nope + v_head_dim),
        kv_lora_rank), kv_b_proj's -> (T, H * v_head_dim)."""
        metadata = get_forward_context().attention[self.kv_group]
        if self.k_cache.numel() == 0:
            q, k, v = _same_head_dim(query, *self._up_project(latent, kv_b_weight))
            out = varlen_attention(
                q, k, v, metadata.cu_seqlens_q, metadata.max_seqlen_q, self.scale
            )
        else:
            store_latent(latent[:, None], self.k_cache, metadata.slot_mapping)
            if metadata.is_prefill:
                out = self._prefill(query, kv_b_weight, metadata)
            else:
                out = self._decode(query, kv_b_weight, metadata)
        return out[..., : self.v_head_dim].flatten(1)

    def _up_project(
        self, latent: torch.Tensor, kv_b_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows (S, kv_lora_rank + qk_rope) -> K (S, H, qk_nope + qk_rope), the
        shared rotary key repeated per head, and V (S, H, v_head_dim), as transformers
        expands its cached latents."""
        compressed, k_rot = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = F.linear(compressed, kv_b_weight).unflatten(-1, (self.num_heads, -1))
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rot = k_rot[:, None].expand(-1, self.num_heads, -1)
        return torch.cat((k_nope, k_rot), dim=-1), v

    def _prefill(
        self, query: torch.Tensor, kv_b_weight: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Each sequence's queries against its whole context (a cached prefix included),
        up-projected from the cache; memory linear in the context."""
        latents = self.k_cache[:, :, 0]
        cu = metadata.cu_seqlens_q.tolist()
        outs = []
        for s, context_len in enumerate(metadata.context_lens.tolist()):
            context = gather_context(latents, metadata.block_tables[s], context_len)
            k, v = self._up_project(context, kv_b_weight)
            q, k, v = _same_head_dim(query[cu[s] : cu[s + 1]], k, v)
            outs.append(causal_attention(q, k, v, self.scale).to(query.dtype))
        return torch.cat(outs)

    def _decode(
        self, query: torch.Tensor, kv_b_weight: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """One query per sequence against its latent rows, kv_b_proj absorbed: the paged
        attention kernel's multi-query case, the latent row as both key and value."""
        q_nope, q_rot = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # Per head the K rows (W_UK) then the V rows (W_UV) of kv_b_proj, as views.
        w_kv = kv_b_weight.view(self.num_heads, -1, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (T, H, rank)
        absorbed = torch.cat((q_latent, q_rot), dim=-1)
        attended = paged_attention(absorbed, self.k_cache, self.v_cache, metadata, self.scale)
        # The value is the latent part of each row: lift it to every head's value.
        latent_out = attended[..., : self.kv_lora_rank].transpose(0, 1)
        return torch.bmm(latent_out, w_uv.transpose(1, 2)).transpose(0, 1)
