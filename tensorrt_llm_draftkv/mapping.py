"""`Mapping`: where this rank sits in the parallel layout, as far as the KV cache needs it.

Upstream's `tensorrt_llm.mapping.Mapping` knows every parallelism TensorRT-LLM
supports. The KV cache reads only a few of its fields: tensor parallelism splits
the KV heads across ranks, pipeline and context parallelism would split the
layers and the tokens. This one takes the same keyword arguments and answers
those fields; the managers refuse the layouts they do not implement (pipeline
and context parallelism) with an error that names them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Mapping:
    """One rank's place in a `world_size = tp_size * pp_size * cp_size` layout (defaults: one rank)."""

    world_size: int = 1
    rank: int = 0
    gpus_per_node: int = 8
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    moe_tp_size: int = -1
    moe_ep_size: int = -1
    enable_attention_dp: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "cp_size", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"Mapping: {name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size * self.pp_size * self.cp_size != self.world_size:
            raise ValueError(
                f"Mapping: world_size {self.world_size} != tp_size {self.tp_size} * pp_size {self.pp_size} "
                f"* cp_size {self.cp_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mapping: rank {self.rank} outside [0, {self.world_size})")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size)

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp_size % self.cp_size

    @property
    def dp_size(self) -> int:
        """Attention data parallelism: every TP rank serves its own requests."""
        return self.tp_size if self.enable_attention_dp else 1

    def has_pp(self) -> bool:
        return self.pp_size > 1

    def has_cp(self) -> bool:
        return self.cp_size > 1

    def has_cp_helix(self) -> bool:
        """No helix context parallelism here (upstream's is a cp_config choice)."""
        return False

    def local_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads this rank holds: the heads split across TP ranks (at least one each; with attention
        DP every rank holds them all)."""
        if num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
        if self.enable_attention_dp:
            return num_kv_heads
        return max(1, -(-num_kv_heads // self.tp_size))
