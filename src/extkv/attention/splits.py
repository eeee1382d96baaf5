"""A decode attention's output before its splits are merged.

Decode attention splits each sequence's context over several programs
(flash-decoding, extkv.kernels.paged_attention); each split leaves its own softmax
output and the log-sum-exp of its scores, which a merge weighs together. On CUDA the
attention layer hands the splits on unmerged and the output projection merges them in
its GEMV's input where that runs (extkv.models.ops.merge_splits_linear): one kernel
fewer per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AttentionSplits(NamedTuple):
    """Per-split results of a decode attention over `out.shape[2]` splits."""

    out: torch.Tensor  # fp32 (T, Hq, S, D): each split's output, normalised by its own sum
    lse: torch.Tensor  # fp32 (T, Hq, S): each split's log2-sum-exp of its scores (-inf: none)
    dtype: torch.dtype  # the merged output's (the query's)

    def merged(self) -> torch.Tensor:
        """(T, Hq * D) in `dtype`, the layer's output: the splits merged by the merge kernel."""
        from extkv.kernels.paged_attention import merge_attention_splits  # CUDA only

        return merge_attention_splits(self).flatten(1)
