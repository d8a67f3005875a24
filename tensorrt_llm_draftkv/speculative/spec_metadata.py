"""`SpecMetadata`: the per-step record a speculative-decoding drafter reads, in upstream's field names.

The model engine fills `request_ids` (context rows first, then generation rows)
and `num_generations` each step and calls `prepare()`. Only the fields the draft
KV path reads are kept here; sampling and tree-decoding fields are not (they
mean nothing to the KV cache).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..config import SpeculativeDecodingMode


@dataclass
class SpecMetadata:
    """Upstream's base metadata (the KV-relevant subset, same names and defaults)."""

    max_num_requests: int
    max_draft_len: int
    max_total_draft_tokens: int
    num_generations: int = 0
    is_cuda_graph: bool = field(default=False, repr=False)
    spec_dec_mode: SpeculativeDecodingMode = SpeculativeDecodingMode.NONE
    draft_tokens: Optional[torch.Tensor] = None
    draft_lens: Optional[torch.Tensor] = None
    request_ids: Optional[List[int]] = None
    seq_lens: Optional[List[int]] = None
    gather_ids: Optional[torch.Tensor] = None
    num_accepted_draft_tokens: Optional[torch.Tensor] = None
    num_tokens: int = 0
    num_extra_kv_tokens: Optional[int] = 0
    num_layers: int = 0
    is_spec_dec_tree: bool = False
    is_spec_dec_dynamic_tree: bool = False
    runtime_draft_len: int = 0
    runtime_tokens_per_gen_step: int = 1

    def __post_init__(self) -> None:
        if self.max_num_requests < 1:
            raise ValueError(f"{type(self).__name__}: max_num_requests must be >= 1, got {self.max_num_requests}")
        if self.max_draft_len < 0:
            raise ValueError(f"{type(self).__name__}: max_draft_len must be >= 0, got {self.max_draft_len}")

    @property
    def num_seqs(self) -> int:
        """Rows of this step (ours): `len(request_ids)`, 0 before the first step."""
        return 0 if self.request_ids is None else len(self.request_ids)

    @property
    def num_contexts(self) -> int:
        """Context rows of this step (ours): they come first in `request_ids`."""
        return self.num_seqs - self.num_generations

    def prepare(self) -> None:
        """Hook called before the model's forward; the base metadata has nothing to prepare."""

    def create_cuda_graph_metadata(self, max_batch_size: int) -> "SpecMetadata":
        """A copy for CUDA-graph capture at `max_batch_size` rows (itself if it already is one)."""
        if self.is_cuda_graph:
            return self
        graph = copy.copy(self)
        graph.is_cuda_graph = True
        graph.max_num_requests = max_batch_size
        graph.__post_init__()
        return graph

    def is_layer_capture(self, layer_id: int) -> bool:
        """Whether the target's layer `layer_id` hands its hidden states to the drafter."""
        return False

    def maybe_capture_hidden_states(
        self, layer_id: int, hidden_states: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> None:
        """Keep a target layer's hidden states for the drafter; the base metadata keeps none."""


__all__ = ["SpecMetadata"]
