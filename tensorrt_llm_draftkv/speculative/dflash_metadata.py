"""`DFlashSpecMetadata`: upstream's DFlash metadata dataclass, whose `prepare()` maps rows to slots.

The model engine sets `request_ids` and `num_generations` and calls `prepare()`
with no arguments, as upstream does. The mapping is the worker's job
(`DFlashWorker`, attached as `_dflash_worker`): free the slots of requests that
left, give new requests slots (a fresh generation slot gets the fix's base),
and write the batch-row -> slot table the kernels read. The metadata also keeps
the target layers' hidden states the drafter projects (`captured_hidden_states`,
`[max_num_tokens, hidden_size * layers]`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional

import torch

from ..request import ScheduledRequests
from .spec_metadata import SpecMetadata

if TYPE_CHECKING:
    from .dflash_worker import DFlashWorker


@dataclass
class DFlashSpecMetadata(SpecMetadata):
    """Upstream's fields, plus two of ours (`device`, `scheduled_requests`), both keyword-optional.

    `scheduled_requests` (ours): the step's request objects, when the draft manager
    did not see the step (a private arena); otherwise the worker reads them from
    the draft manager's last `prepare_resources`.
    """

    batch_indices_cuda: Optional[torch.Tensor] = None
    spec_resource_manager: Any = None
    layers_to_capture: Optional[List[int]] = None
    hidden_size: int = 0
    max_num_tokens: int = 0
    dtype: torch.dtype = torch.bfloat16
    captured_hidden_states: Optional[torch.Tensor] = None
    device: Optional[torch.device] = field(default=None, repr=False)
    scheduled_requests: Optional[ScheduledRequests] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device is None:
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(self.device)
        # arange(max_num_requests) once: `prepare()` then has nothing to copy (a copy from pageable
        # memory would wait for the device every step); it refills only after someone else wrote here
        self.batch_indices_cuda = torch.arange(self.max_num_requests, dtype=torch.int32, device=self.device)
        self._indices_version = self.batch_indices_cuda._version
        self.is_spec_dec_tree = False
        self.is_spec_dec_dynamic_tree = False
        layers = sorted(self.layers_to_capture) if self.layers_to_capture else []
        self.layers_to_capture = layers or None
        self.num_capture_layers = len(layers)
        self._layer_to_idx = {layer: i for i, layer in enumerate(layers)}
        if layers:
            if self.hidden_size < 1 or self.max_num_tokens < 1:
                raise ValueError(
                    f"DFlashSpecMetadata: capturing layers {layers} needs hidden_size >= 1 and max_num_tokens >= 1, "
                    f"got {self.hidden_size} and {self.max_num_tokens}"
                )
            self.captured_hidden_states = torch.empty(
                (self.max_num_tokens, self.hidden_size * len(layers)), dtype=self.dtype, device=self.device
            )

    def prepare(self) -> None:
        """Before the forward: batch indices, then the worker's slot mapping of `request_ids`.

        `request_ids` lists the context rows, then the `num_generations` generation
        rows. Without an attached, initialised worker only the batch indices are set.
        Errors (a row the draft manager never sized, too many requests for the slots)
        raise before any slot changes.
        """
        if self.request_ids is None:
            raise ValueError("DFlashSpecMetadata.prepare(): request_ids is not set for this step")
        n = len(self.request_ids)
        if n > self.max_num_requests:
            raise ValueError(f"DFlashSpecMetadata.prepare(): {n} rows, but max_num_requests is {self.max_num_requests}")
        if not 0 <= self.num_generations <= n:
            raise ValueError(f"DFlashSpecMetadata.prepare(): num_generations {self.num_generations} of {n} rows")
        if self.batch_indices_cuda._version != self._indices_version:
            self.batch_indices_cuda.copy_(torch.arange(self.batch_indices_cuda.numel(), dtype=torch.int32))
            self._indices_version = self.batch_indices_cuda._version
        worker: DFlashWorker | None = getattr(self, "_dflash_worker", None)
        if worker is not None and worker.is_bound:
            worker.map_batch_rows(self)

    def attach_worker(self, worker: DFlashWorker) -> None:
        """The worker whose slots `prepare()` maps rows to (kept as upstream's `_dflash_worker`)."""
        self._dflash_worker = worker

    def is_layer_capture(self, layer_id: int) -> bool:
        return layer_id in self._layer_to_idx

    def maybe_capture_hidden_states(
        self, layer_id: int, hidden_states: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> None:
        """Copy a captured layer's `hidden_states (+ residual)` `[num_tokens, hidden_size]` into its section."""
        if self.captured_hidden_states is None:
            return
        i = self._layer_to_idx.get(layer_id)
        if i is None:
            return
        value = hidden_states if residual is None else hidden_states + residual
        h = self.hidden_size
        self.captured_hidden_states[: value.shape[0], i * h : (i + 1) * h].copy_(value)

    def get_hidden_states(self, num_tokens: int) -> Optional[torch.Tensor]:
        """The first `num_tokens` captured rows, all captured layers side by side."""
        if self.captured_hidden_states is None:
            return None
        return self.captured_hidden_states[:num_tokens, : self.hidden_size * self.num_capture_layers]


__all__ = ["DFlashSpecMetadata"]
