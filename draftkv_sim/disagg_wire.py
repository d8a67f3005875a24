"""The 1P1D wire: what the context worker (rank 0) and the generation worker (rank 1) exchange per request.

Coordinates: absolute token positions; `m` is the prompt length. Every message
is int64 unless said otherwise, sent with torch.distributed point-to-point
calls (gloo on CPU, NCCL with a GPU per rank) on the wire device.

Per request, three messages, always in this order (the round trip):

1. **Offer** (rank 0 -> 1): `[request_id, prompt_len, num_tokens]`, then the
   `num_tokens = m + 1` token ids (the prompt and the first token). A header
   with request_id -1 (and nothing after it) ends the stream.
2. **Reply** (rank 1 -> 0): `[request_id, gen_reused_tokens, gen_drafter_reused]`:
   the prefix the generation worker's pools will adopt for this request
   (`find_gen_init_hit`, whole pages; 0 without block reuse there) and the part
   of it its draft pool adopts too (the same hit under joint reuse, else 0).
   The generation worker answers before it receives anything else and does
   nothing in between, so the hit still holds when the payload arrives.
3. **Payload** (rank 0 -> 1): a header `[request_id, prompt_len, num_groups,
   num_drafts, drafter_context, reused_tokens, drafter_lo, drafter_floor,
   gen_reused_tokens, gen_drafter_reused, lo_0, ..]`, then K and V of positions
   `[lo_g, m)` for each target layer group g (`lo_g = max(window start,
   gen_reused_tokens)`), the draft tokens (when num_drafts > 0), then, when
   drafter_context is 1, the drafter context: its geometry header
   (`DrafterContextGeometry.to_wire`, version first) and its tensors, shaped by
   that header and clipped to start at `drafter_floor` or later (form `kv`:
   `[n_g, layers_g, 2, heads, head_dim]` per draft group; form `hidden`: one
   `[n, hidden_size]`). `reused_tokens` is the context worker's own prefix hit;
   `drafter_lo` the lowest position its drafter context holds (its hit without
   joint reuse, else 0): the generation worker's slot starts there or later;
   `drafter_floor = max(drafter_lo, gen_drafter_reused)`: what is sent.

Neither rank can deadlock on it: rank 0 runs the round trip from
`executor.on_complete` and blocks until rank 1 reads; rank 1 reads an offer
only when it has room for a request (or is draining), then answers and reads
the payload at once. Both follow the same order, one request at a time.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tensorrt_llm_draftkv.speculative.handoff import HEADER_INTS, DrafterContextGeometry, HandoffForm

MAX_GROUPS = 8
_OFFER = 3
_REPLY = 3
_FIXED = 10  # payload header ints before the per-group `lo_g`
_HEADER = _FIXED + MAX_GROUPS


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Channel:
    """Point-to-point messages between the two ranks; tensors travel on the wire device."""

    def __init__(self, peer: int, wire_device: torch.device, dim: int, dtype: torch.dtype) -> None:
        self.peer = peer
        self.wire = wire_device
        self.dim = dim
        self.dtype = dtype

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

    # -- step 2 ----------------------------------------------------------------------
    def send_reply(self, hit: GenHit) -> None:
        self._ints([hit.request_id, hit.tokens, hit.drafter_tokens])

    def recv_reply(self, request_id: int) -> GenHit:
        rid, tokens, drafter_tokens = self._recv_ints(_REPLY)
        if rid != request_id:
            raise RuntimeError(f"the generation worker answered for request {rid}, expected request {request_id}")
        return GenHit(rid, tokens, drafter_tokens)

    # -- step 3 ----------------------------------------------------------------------
    def send(self, item: Transfer) -> None:
        """The payload of an offer already answered (the tokens went with the offer)."""
        header = torch.full((_HEADER,), -1, dtype=torch.long)
        header[:_FIXED] = torch.tensor([
            item.request_id, item.prompt_len, len(item.group_lo), len(item.drafts),
            int(item.drafter_geometry is not None), item.reused_tokens, item.drafter_lo, item.drafter_floor,
            item.gen_reused_tokens, item.gen_drafter_reused,
        ])
        header[_FIXED : _FIXED + len(item.group_lo)] = torch.tensor(item.group_lo)
        dist.send(header.to(self.wire), self.peer)
        for k, v in zip(item.keys, item.values):
            dist.send(k.to(self.wire, self.dtype).contiguous(), self.peer)
            dist.send(v.to(self.wire, self.dtype).contiguous(), self.peer)
        if item.drafts:
            dist.send(torch.tensor(item.drafts, dtype=torch.long, device=self.wire), self.peer)
        if item.drafter_geometry is not None:
            geometry = item.drafter_geometry
            dist.send(torch.tensor(geometry.to_wire(), dtype=torch.long, device=self.wire), self.peer)
            shapes = payload_shapes(geometry, item.prompt_len, item.drafter_floor)
            for t, (shape, dtype) in zip(item.drafter_payload, shapes):
                if tuple(t.shape) != shape:
                    raise ValueError(
                        f"request {item.request_id}: drafter context tensor {tuple(t.shape)}, the header says {shape}"
                    )
                dist.send(t.to(self.wire, dtype).contiguous(), self.peer)

    def recv(self, offer: Offer) -> Transfer:
        """The payload that follows `offer` and its reply."""
        header = self._recv_ints(_HEADER)
        (rid, prompt_len, num_groups, num_drafts, has_ctx, reused, drafter_lo, floor, gen_reused,
         gen_drafter) = header[:_FIXED]
        if (rid, prompt_len) != (offer.request_id, offer.prompt_len):
            raise RuntimeError(
                f"payload for request {rid} ({prompt_len} tokens) after the offer of request "
                f"{offer.request_id} ({offer.prompt_len} tokens)"
            )
        group_lo = header[_FIXED : _FIXED + num_groups]
        keys, values = [], []
        for lo in group_lo:
            k = torch.empty(prompt_len - lo, self.dim, dtype=self.dtype, device=self.wire)
            v = torch.empty_like(k)
            dist.recv(k, self.peer)
            dist.recv(v, self.peer)
            keys.append(k)
            values.append(v)
        item = Transfer(rid, prompt_len, offer.tokens, group_lo, keys, values, reused_tokens=reused,
                        drafter_lo=drafter_lo, gen_reused_tokens=gen_reused, gen_drafter_reused=gen_drafter)
        if item.drafter_floor != floor:
            raise RuntimeError(f"request {rid}: payload header floor {floor} != max({drafter_lo}, {gen_drafter})")
        if num_drafts > 0:
            drafts = torch.empty(num_drafts, dtype=torch.long, device=self.wire)
            dist.recv(drafts, self.peer)
            item.drafts = drafts.cpu().tolist()
        if has_ctx:
            raw = torch.empty(HEADER_INTS, dtype=torch.long, device=self.wire)
            dist.recv(raw, self.peer)
            # Shaped by the sender's header, whatever this worker expects: the stream stays in step
            # and the receiver decides afterwards whether to take it.
            geometry = DrafterContextGeometry.from_wire(raw.cpu().tolist())
            item.drafter_geometry = geometry
            for shape, dtype in payload_shapes(geometry, prompt_len, floor):
                t = torch.empty(shape, dtype=dtype, device=self.wire)
                dist.recv(t, self.peer)
                item.drafter_payload.append(t)
        return item
