"""Mixture-of-experts MLPs (DeepSeek V2/V3, Qwen3-MoE): a router picks each token's experts,
whose weights are stacked per layer, and `ops.moe_experts` runs them (a torch loop on the
CPU, exact against transformers; fused Triton kernels on CUDA, captured in CUDA graphs).

Checkpoints keep each expert's projections as tensors of their own
(`experts.{e}.gate_proj.weight`, ...): `Experts` names them for the loader, which copies
each into its expert's slice of the stacked parameters. transformers 5 stacks them the
same way in memory (`experts.gate_up_proj`, `experts.down_proj`): a `state_dict()` of its
model fills them whole (`LLM.load_weights`).

Under tensor parallelism every rank holds every expert, but only its slice of each
expert's intermediate features (gate and up rows, down columns), as the dense MLP splits
them; the router is replicated. Each rank's routed and shared experts give a partial
output, summed over the ranks by one all-reduce per layer.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from extkv.distributed import current_group
from extkv.models import ops
from extkv.models.layers import GatedMLP, RMSNorm
from extkv.models.parallel import load_shards, split_evenly, stacked

ROUTER_METHODS = ("greedy", "group_limited_greedy", "sigmoid")


def _keep_groups(
    scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """`scores` (T, experts) with every expert outside the `topk_group` best of its token's
    groups (group_scores (T, groups)) set to `fill`."""
    groups = group_scores.shape[-1]
    best = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter_(1, best, 1)
    kept = kept.unsqueeze(-1).expand(-1, groups, scores.shape[-1] // groups).flatten(1)
    return scores.masked_fill(~kept.bool(), fill)


class Router(nn.Module):
    """Picks each token's `top_k` experts and their weights, by `method`:

    - greedy: the best softmax scores (DeepSeek-V2, Qwen3-MoE);
    - group_limited_greedy: the same among the `topk_group` groups (of `n_group`) with the
      best single score (DeepSeek-V2);
    - sigmoid: experts chosen by sigmoid score plus `e_score_correction_bias` among the
      groups whose two best such scores sum highest, weighted by their plain scores
      (DeepSeek-V3).

    The weights are normalised to sum to 1 when `norm_topk_prob`, then scaled by `scale`.
    The logits are taken in the router weight's dtype (`weight_dtype`: DeepSeek keeps it in
    fp32, Qwen3-MoE in the model's), scores in fp32, and the weights come back in the
    logits' dtype, as transformers has each."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        method: str = "greedy",
        *,
        n_group: int | None = None,
        topk_group: int | None = None,
        norm_topk_prob: bool = False,
        scale: float = 1.0,
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if method not in ROUTER_METHODS:
            raise ValueError(f"router method must be one of {ROUTER_METHODS}, got {method!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {num_experts}] (the number of experts), "
                f"got {top_k}"
            )
        if method != "greedy" and not (n_group and topk_group):
            raise ValueError(
                f"grouped expert routing needs n_group and topk_group; got n_group={n_group}, "
                f"topk_group={topk_group}"
            )
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=weight_dtype))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
            if method == "sigmoid"
            else None
        )
        self.method = method
        self.top_k = top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.scale = scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden_size) -> (weights (T, top_k), expert indices (T, top_k))."""
        logits = ops.linear(x.to(self.weight.dtype), self.weight)
        if self.method == "sigmoid":
            scores = logits.float().sigmoid()
            choice = scores + self.e_score_correction_bias
            grouped = choice.unflatten(-1, (self.n_group, -1))
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            choice = _keep_groups(choice, group_scores, self.topk_group, float("-inf"))
            indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, indices)
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if self.method == "group_limited_greedy":
                group_scores = scores.unflatten(-1, (self.n_group, -1)).max(dim=-1).values
                scores = _keep_groups(scores, group_scores, self.topk_group, 0.0)
            weights, indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights.to(logits.dtype), indices


class Experts(nn.Module):
    """The routed experts' weights, stacked: gate_up_proj (E, 2I, H), each expert's gate
    rows then up rows, and down_proj (E, H, I): the fused kernels' operands, filled from
    the checkpoint's per-expert tensors. Under tensor parallelism I is this rank's slice of
    `intermediate_size` (the config's `moe_intermediate_size`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.shard = split_evenly(intermediate_size, "moe_intermediate_size")
        inner = self.shard.size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inner))
        # Each parameter's intermediate features lie along a dim of its own.
        self.gate_up_proj.weight_loader = functools.partial(self.weight_loader, inner_dim=1)
        self.down_proj.weight_loader = functools.partial(self.weight_loader, inner_dim=2)

    def checkpoint_parts(self, param_name: str) -> list[str]:
        """The checkpoint tensors (names under this module) that fill `param_name`."""
        projections = ("gate_proj", "up_proj") if param_name == "gate_up_proj" else ("down_proj",)
        return [f"{e}.{p}.weight" for e in range(self.num_experts) for p in projections]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, part: str | None, *, inner_dim: int
    ) -> None:
        """Copy this rank's slice of checkpoint tensor `part` ("{expert}.{projection}.weight")
        into its expert, or (`part` None) of the whole stacked tensor, laid out as
        transformers 5 stacks it; `inner_dim`: the stacked dim of the intermediate features
        (gate_up_proj's 1, gate rows then up rows; down_proj's 2)."""
        shard = self.shard
        if part is None:
            shards = stacked([shard, shard]) if inner_dim == 1 else [shard]
            load_shards(param.data, loaded, shards, dim=inner_dim)
            return
        expert, projection, _ = part.split(".")
        dst = param.data[int(expert)]
        if projection == "down_proj":
            load_shards(dst, loaded, [shard], dim=1)
            return
        rows = dst[: shard.size] if projection == "gate_proj" else dst[shard.size :]
        load_shards(rows, loaded, [shard])


class MixtureOfExperts(nn.Module):
    """A mixture-of-experts MLP: each token through the experts its router picks, weighted,
    plus the `n_shared_experts` shared experts every token takes (DeepSeek's, of the routed
    experts' size, fused into one `GatedMLP`; none for Qwen3-MoE). Called as `GatedMLP` is:
    one RMSNorm before, its residual add fused in."""

    def __init__(
        self,
        gate: Router,
        hidden_size: int,
        intermediate_size: int,
        n_shared_experts: int = 0,
        shared_bias: bool = False,
    ) -> None:
        super().__init__()
        self.tp = current_group()
        self.gate = gate
        # Before the shared experts: an indivisible size is refused as moe_intermediate_size.
        self.experts = Experts(gate.weight.shape[0], hidden_size, intermediate_size)
        self.shared_experts = (
            GatedMLP(hidden_size, intermediate_size * n_shared_experts, shared_bias)
            if n_shared_experts
            else None
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `GatedMLP.forward`: (experts' output of `norm(x, residual)`, summed over the
        ranks once, routed and shared together; the residual stream)."""
        h, residual = norm(x, residual)
        weights, indices = self.gate(h)
        shared = None if self.shared_experts is None else self.shared_experts.feed_forward(h)
        experts = self.experts
        out = ops.moe_experts(h, experts.gate_up_proj, experts.down_proj, weights, indices, shared)
        return self.tp.all_reduce(out), residual
