"""The 1P1D control wire: what the context worker (rank 0) and the generation worker (rank 1) say per request.

Coordinates: absolute token positions; `m` is the prompt length. Every message
is int64 unless said otherwise, sent with torch.distributed point-to-point
calls (gloo on CPU, NCCL with a GPU per rank) on the wire device. The bytes
themselves (target K/V pages, drafter-context pages, the auxiliary slot) move
through a transfer agent (`tensorrt_llm_draftkv.transfer`, NIXL or this same
torch.distributed group); disagg_pages.py has the page handshake.

Once per run each rank sends its agent descriptor and its registered memory
(`send_bytes` / `send_array`), rank 0 first. Then per request, in this order:

1. **Offer** (rank 0 -> 1): `[request_id, prompt_len, num_tokens]`, then the
   `num_tokens = m + 1` token ids (the prompt and the first token). A header
   with request_id -1 (and nothing after it) ends the stream. Then the
   context worker's facts (`disagg_pages.ContextFacts`): its own prefix hit,
   the lowest position its drafter context holds (`drafter_lo`), and the
   drafter context's geometry header (`DrafterContextGeometry.to_wire`) or none.
2. **Handshake** (rank 1 -> 0, `disagg_pages.PageHandshake`): accepted or not;
   the prefix its pools adopted (`gen_reused_tokens`, whole pages, and the
   part its draft pool adopts, `gen_drafter_reused`); per target group the
   first position it reads (`lo_g = max(window start, gen_reused_tokens)`) and
   its pages for ordinals `lo_g // P .. (m - 1) // P`; per draft group (kv
   form) the same for the drafter context `[max(group start,
   drafter_floor), m)`, `drafter_floor = max(drafter_lo, gen_drafter_reused)`;
   the auxiliary slot. The generation worker builds both generation-init
   caches before it answers and does nothing in between, so the pages are
   its own until the transfer lands or fails.
3. **Transfer** (rank 0 -> 1, through the agent): one WRITE of every page and
   the auxiliary bytes (drafts; `hidden`-form context), with the sync
   message `request <id>`. Nothing when the handshake said no.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tensorrt_llm_draftkv.speculative.handoff import DrafterContextGeometry, HandoffForm

_OFFER = 3


@dataclass(frozen=True)
class Offer:
    """Step 1: a request whose first token exists on the context worker (`tokens`: prompt + first token)."""

    request_id: int
    prompt_len: int
    tokens: torch.Tensor


@dataclass(frozen=True)
class GenHit:
    """Step 2: what the generation worker already holds of a request's prompt, in tokens from position 0.

    `tokens`: target K/V it adopts (`find_gen_init_hit`); `drafter_tokens`: drafter
    context its draft pool adopts (joint reuse: the same hit; else 0).
    """

    request_id: int
    tokens: int = 0
    drafter_tokens: int = 0


@dataclass
class Transfer:
    """Step 3, one request from the context worker: tokens, target K/V of `[group_lo[g], prompt_len)`, and
    optionally the drafts and the drafter context (`drafter_geometry` describes `drafter_payload`)."""

    request_id: int
    prompt_len: int
    tokens: torch.Tensor
    group_lo: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    drafts: list[int] = field(default_factory=list)
    drafter_geometry: DrafterContextGeometry | None = None
    drafter_payload: list[torch.Tensor] = field(default_factory=list)
    reused_tokens: int = 0  # the context worker's prefix hit (block reuse)
    drafter_lo: int = 0  # the drafter context held from here on (the slot starts here or later)
    gen_reused_tokens: int = 0  # the generation worker's hit: no target K/V below it is sent
    gen_drafter_reused: int = 0  # the part its draft pool holds: no drafter context below it is sent

    @property
    def drafter_floor(self) -> int:
        """The drafter context sent starts at this position or later (see `clipped_ranges`)."""
        return max(self.drafter_lo, self.gen_drafter_reused)

    @property
    def drafter_bytes(self) -> int:
        """Bytes of the drafter context on the wire (0 without one)."""
        return sum(t.numel() * t.element_size() for t in self.drafter_payload)

    @property
    def target_bytes(self) -> int:
        """Bytes of the target K/V on the wire."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def clipped_ranges(geometry: DrafterContextGeometry, prompt_len: int, floor: int = 0) -> list[tuple[int, int]]:
    """Per draft layer group, the absolute positions `[lo, m)` of drafter context sent: the geometry's
    `ranges(m)` with each start raised to `floor` (a drafter that computed only `[floor, m)`)."""
    return [(min(max(lo, floor), hi), hi) for lo, hi in geometry.ranges(prompt_len)]


def clipped_hidden_range(geometry: DrafterContextGeometry, prompt_len: int, floor: int = 0) -> tuple[int, int]:
    """`geometry.hidden_range(m)` with its start raised to `floor`."""
    lo, hi = geometry.hidden_range(prompt_len)
    return min(max(lo, floor), hi), hi


def payload_shapes(
    geometry: DrafterContextGeometry, prompt_len: int, floor: int = 0
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every drafter-context tensor a header announces, in wire order."""
    if geometry.form is HandoffForm.HIDDEN:
        lo, hi = clipped_hidden_range(geometry, prompt_len, floor)
        return [((hi - lo, geometry.hidden_size), geometry.hidden_dtype or geometry.dtype)]
    return [
        ((hi - lo, n, 2, geometry.num_kv_heads, geometry.head_dim), geometry.dtype)
        for (lo, hi), n in zip(clipped_ranges(geometry, prompt_len, floor), geometry.layers)
    ]


def payload_bytes(geometry: DrafterContextGeometry, prompt_len: int, floor: int = 0) -> int:
    """Bytes of the drafter-context tensors a header announces (`payload_shapes`)."""
    total = 0
    for shape, dtype in payload_shapes(geometry, prompt_len, floor):
        count = 1
        for d in shape:
            count *= d
        total += count * torch.empty((), dtype=dtype).element_size()
    return total


class Channel:
    """Point-to-point messages between the two ranks; tensors travel on the wire device."""

    def __init__(self, peer: int, wire_device: torch.device) -> None:
        self.peer = peer
        self.wire = wire_device

    def _ints(self, values: list[int]) -> None:
        dist.send(torch.tensor(values, dtype=torch.long).to(self.wire), self.peer)

    def _recv_ints(self, n: int) -> list[int]:
        t = torch.empty(n, dtype=torch.long, device=self.wire)
        dist.recv(t, self.peer)
        return [int(x) for x in t.cpu().tolist()]

    # -- step 1 ----------------------------------------------------------------------
    def send_offer(self, offer: Offer | None) -> None:
        """An offer, or (None) the end of the stream."""
        if offer is None:
            self._ints([-1] * _OFFER)
            return
        self._ints([offer.request_id, offer.prompt_len, offer.tokens.numel()])
        dist.send(offer.tokens.to(self.wire, torch.long).contiguous(), self.peer)

    def recv_offer(self) -> Offer | None:
        rid, prompt_len, num_tokens = self._recv_ints(_OFFER)
        if rid < 0:
            return None
        tokens = torch.empty(num_tokens, dtype=torch.long, device=self.wire)
        dist.recv(tokens, self.peer)
        return Offer(rid, prompt_len, tokens.cpu())

    # -- variable-length messages -------------------------------------------------------
    def send_array(self, values) -> None:
        """An int64 array of any length (its length first)."""
        t = torch.as_tensor(values, dtype=torch.long).reshape(-1)
        self._ints([t.numel()])
        if t.numel():
            dist.send(t.to(self.wire).contiguous(), self.peer)

    def recv_array(self) -> list[int]:
        (n,) = self._recv_ints(1)
        return self._recv_ints(n) if n else []

    def send_bytes(self, data: bytes) -> None:
        self.send_array(list(data))

    def recv_bytes(self) -> bytes:
        return bytes(self.recv_array())
