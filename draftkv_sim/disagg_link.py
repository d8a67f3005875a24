"""The disaggregated pair's transfer agents: which engine, registration once per run, one transfer per request.

`make_agent` builds a rank's agent once per rank process (NIXL over UCX, or the
torch.distributed wire); `PageLink.connect` registers that run's pools and the
auxiliary buffer and exchanges agent descriptors and registered memory with
the peer over the control channel; `send_request` (context worker) and
`receive_request` (generation worker) run one request's handshake and
transfer (disagg_pages.py, disagg_wire.py). Coordinates: pages and bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tensorrt_llm_draftkv.request import LlmRequest
from tensorrt_llm_draftkv.speculative.handoff import DrafterContextGeometry, DrafterContextMismatch
from tensorrt_llm_draftkv.transfer import (BaseTransferAgent, MemoryDescs, NixlTransferAgent, PeerGone, RankMemory,
                                           TorchWireAgent, TransferError, TransferRequest, nixl_unavailable,
                                           use_loopback)
from .disagg_pages import (ContextFacts, PageHandshake, aux_slot_bytes, check_handshake, handshake_for,
                           hidden_rows, pack_aux, rank_memory, request_pages, unpack_aux, write_descs)
from . import disagg_transfer
from .disagg_transfer import Admission, begin_admission, generation_hit, offer_for, release_admission
from .disagg_wire import Channel, GenHit, Offer, Transfer

TRANSPORTS = ("nixl", "torch")
#: How long a generation worker waits for a request's transfer after its handshake (an executor's
#: `transfer_timeout_s` overrides it). The context worker posts it right after reading the handshake, so
#: only a failure (or a vanished peer) takes this long.
TRANSFER_TIMEOUT_S = 120.0


def resolve_transport(name: str) -> str:
    """`nixl` or `torch` for a setting of `auto` (NIXL when it imports), `nixl` or `torch`.

    `ValueError` for another name, or for `nixl` when NIXL cannot be imported (naming the import error).
    """
    if name == "auto":
        return "nixl" if nixl_unavailable() is None else "torch"
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be auto, nixl or torch, got {name!r}")
    if name == "nixl" and (why := nixl_unavailable()) is not None:
        raise ValueError(f"transport nixl: {why}")
    return name


def make_agent(transport: str, rank: int, tag: str) -> BaseTransferAgent:
    """One rank's agent (after the process group exists): `tag` makes NIXL agent names unique per rank pair."""
    if transport == "nixl":
        use_loopback()  # both ranks on this host: UCX over lo (the environment may say otherwise)
        return NixlTransferAgent(f"draftkv-{tag}-rank{rank}")
    return TorchWireAgent(f"draftkv-{tag}-rank{rank}", 1 - rank)


def agent_transport(agent: BaseTransferAgent) -> str:
    """The transport an agent implements, as `simulate --transport` names it."""
    return "nixl" if isinstance(agent, NixlTransferAgent) else "torch"


@dataclass
class PageLink:
    """One run's link between the two workers: the agent, the control channel, both ranks' registered memory."""

    agent: BaseTransferAgent
    channel: Channel
    local: RankMemory
    remote: RankMemory
    aux: torch.Tensor  # this worker's auxiliary slots, [slots, bytes] uint8
    peer: str
    timeout_s: float = TRANSFER_TIMEOUT_S
    registered: list[MemoryDescs] = field(default_factory=list)
    #: pages (of every layer) and bytes this worker's transfers moved, for the benchmark
    pages_moved: int = 0
    bytes_moved: int = 0

    @classmethod
    def connect(cls, agent: BaseTransferAgent, channel: Channel, executor, rank: int) -> "PageLink":
        """Register this run's pools and auxiliary buffer once, then trade descriptors with the peer
        (rank 0 speaks first, so neither waits on the other)."""
        aux = torch.zeros(1, aux_slot_bytes(executor, executor.scheduler.config.max_draft_len), dtype=torch.uint8)
        local = rank_memory(executor, aux)
        registered = local.memory_descs()
        for descs in registered:
            agent.register_memory(descs)
        mine = (agent.get_local_agent_desc(), local.to_wire())
        if rank == 0:
            channel.send_bytes(mine[0])
            channel.send_array(mine[1])
        theirs = (channel.recv_bytes(), channel.recv_array())
        if rank == 1:
            channel.send_bytes(mine[0])
            channel.send_array(mine[1])
        peer = f"rank{1 - rank}"
        agent.invalidate_remote_agent(peer)  # the previous run's registrations are gone
        agent.load_remote_agent(peer, theirs[0])
        timeout_s = getattr(executor, "transfer_timeout_s", TRANSFER_TIMEOUT_S)  # a run may set its own
        return cls(agent, channel, local, RankMemory.from_wire(theirs[1]), aux, peer, timeout_s, registered)

    def close(self) -> None:
        """Deregister this run's memory (its pools go away with the run)."""
        for descs in self.registered:
            self.agent.deregister_memory(descs)
        self.registered = []


# -- context worker --------------------------------------------------------------------------------------------
def send_facts(channel: Channel, facts: ContextFacts) -> None:
    geometry = [] if facts.geometry is None else facts.geometry.to_wire()
    channel.send_array([facts.reused_tokens, facts.drafter_lo, *geometry])


def recv_facts(channel: Channel) -> ContextFacts:
    ints = channel.recv_array()
    geometry = DrafterContextGeometry.from_wire(ints[2:]) if len(ints) > 2 else None
    return ContextFacts(ints[0], ints[1], geometry)


def send_request(link: PageLink, req: LlmRequest, executor) -> bool:
    """Context worker, a request's first token exists (pages still held): offer it, read the handshake, write
    everything in one transfer and wait until it left. Returns False when the generation worker declined it.

    A transfer the engine refuses or fails raises `TransferError` (the generation worker then times out on
    that request and releases it).
    """
    link.channel.send_offer(offer_for(req))
    plan = disagg_transfer.transfer_plan(req, executor)  # looked up here: tests wrap it
    send_facts(link.channel, ContextFacts(plan.reused_tokens, plan.drafter_lo, plan.drafter_geometry))
    hs = PageHandshake.from_wire(np.asarray(link.channel.recv_array(), dtype=np.int64))
    if hs.request_id != req.py_request_id:
        raise RuntimeError(f"the generation worker answered for request {hs.request_id}, expected "
                           f"request {req.py_request_id}")
    if not hs.accepted:
        return False
    hit = GenHit(hs.request_id, hs.gen_reused_tokens, hs.gen_drafter_reused)
    item = disagg_transfer.transfer_plan(req, executor, hit)
    if not hs.drafter_context:
        item.drafter_geometry = None  # the generation worker drops it: send the drafts only
    check_handshake(item, hs)
    hidden = None
    if hidden_rows(item):
        (hidden,) = executor.speculator.export_context(req, executor.tokens[item.request_id], item.drafter_geometry,
                                                       floor=item.drafter_floor)
    aux = pack_aux(item, hidden.cpu() if hidden is not None else None)
    link.aux[0, : aux.numel()] = aux
    src, dst = write_descs(link.local, link.remote, request_pages(executor, item, "sending"), hs, 0, aux.numel())
    request = TransferRequest("WRITE", MemoryDescs(link.local.aux.mem_type, src),
                              MemoryDescs(link.remote.aux.mem_type, dst), link.peer, sync_message(item.request_id))
    link.agent.submit_transfer_requests(request).wait(link.timeout_s)
    link.pages_moved += int(sum(p.size for p in (*hs.target_pages, *hs.draft_pages)))
    link.bytes_moved += int(src[:, 1].sum())
    return True


def sync_message(request_id: int) -> bytes:
    """The notification naming a request's transfer."""
    return f"request {request_id}".encode()


# -- generation worker ----------------------------------------------------------------------------------------
def recv_offer(link: PageLink) -> tuple[Offer, ContextFacts] | None:
    """The next offer and its facts, or None at the end of the stream."""
    offer = link.channel.recv_offer()
    return None if offer is None else (offer, recv_facts(link.channel))


def planned_item(offer: Offer, facts: ContextFacts, hit: GenHit, executor) -> Transfer:
    """The request's `Transfer` as far as the header goes (no bytes yet): ranges from this worker's hit."""
    from tensorrt_llm_draftkv.manager.gen_init_reuse import receive_start

    m = offer.prompt_len
    group_lo = [receive_start(g.life_cycle.window, m, hit.tokens) for g in executor.target_manager.layer_groups]
    return Transfer(offer.request_id, m, offer.tokens, group_lo, [], [], drafter_geometry=facts.geometry,
                    reused_tokens=facts.reused_tokens, drafter_lo=facts.drafter_lo, gen_reused_tokens=hit.tokens,
                    gen_drafter_reused=hit.drafter_tokens)


def decline(link: PageLink, request_id: int) -> None:
    """Tell the context worker not to send this request."""
    link.channel.send_array(PageHandshake(request_id, False).to_wire())


def open_admission(link: PageLink, offer: Offer, facts: ContextFacts, executor) -> Admission:
    """Generation worker: build both generation-init caches and send the page handshake. A refusal
    (`AdmissionRefused`, `DrafterContextMismatch`, the manager's resize error) declines the request first."""
    item = planned_item(offer, facts, generation_hit(offer, executor), executor)
    try:
        admission = begin_admission(item, executor)
    except Exception:
        decline(link, offer.request_id)
        raise
    try:
        hs = handshake_for(executor, item, 0, admission.take_context)
    except Exception:
        release_admission(admission, executor)
        decline(link, offer.request_id)
        raise
    link.channel.send_array(hs.to_wire())
    return admission


def land_request(link: PageLink, admission: Admission, executor) -> LlmRequest:
    """Generation worker, handshake sent: wait for the request's transfer, then make it decode.

    A transfer that fails, times out or whose peer is gone raises `TransferError` after everything the
    request held is released; so does a landed payload that does not fit (as `ValueError`).
    """
    item, req = admission.item, admission.req
    try:
        link.agent.wait_sync_message(sync_message(item.request_id), link.timeout_s)
        unpack_aux(link.aux[0], item, admission.take_context)
        if admission.take_context and item.drafter_geometry is not None and not hidden_rows(item):
            # kv form: the context landed on this worker's own pages; the checked store re-declares it
            # (same bytes) so the ownership checker knows what each position holds, and seeds the slot.
            item.drafter_payload = [t.cpu() for t in executor.speculator.export_context(
                req, item.tokens, item.drafter_geometry, floor=item.drafter_floor)]
    except Exception:
        release_admission(admission, executor)
        raise
    return disagg_transfer.finish_admission(admission, executor, target_written=True)  # tests wrap it


def admit_next(link: PageLink, executor, dead: bool) -> tuple[bool, bool]:
    """Generation worker: the next offer, its handshake and its transfer (declined when `dead`).

    Returns `(more offers may come, executor dead)`. A refused request is counted and the others go on; a
    transfer that fails, times out or whose peer is gone is released, recorded in
    `stats.transfer_failures` with the reason, and the others go on; a context worker that is gone ends
    the stream.
    """
    from tensorrt_llm_draftkv.manager import KVCacheResizeError
    from tensorrt_llm_draftkv.manager.admission import AdmissionRefused

    stats = executor.stats
    try:
        got = recv_offer(link)
    except RuntimeError as err:  # the control channel's peer is gone (gloo: connection closed)
        stats.first_error = stats.first_error or f"the context worker is gone: {str(err).splitlines()[0]}"
        return False, dead
    if got is None:
        return False, dead
    offer, facts = got
    if dead:
        decline(link, offer.request_id)
        return True, dead
    try:
        admission = open_admission(link, offer, facts, executor)
    except (AdmissionRefused, DrafterContextMismatch) as err:
        executor.refuse(err)  # this request never runs; the others go on
        return True, dead
    except KVCacheResizeError as err:
        # The executor dies here; keep draining so the context worker can finish.
        stats.resize_failures += 1
        stats.first_error = stats.first_error or str(err).splitlines()[0]
        return True, True
    try:
        land_request(link, admission, executor)
    except TransferError as err:  # released already: this request failed, the others go on
        reason = f"request {offer.request_id}: {str(err).splitlines()[0]}"
        stats.transfer_failures[offer.request_id] = reason
        stats.first_error = stats.first_error or reason
        return not isinstance(err, PeerGone), dead  # a peer that is gone sends no more offers
    return True, dead


__all__ = ["TRANSPORTS", "TRANSFER_TIMEOUT_S", "PageLink", "TransferError", "admit_next", "agent_transport",
           "decline", "land_request", "make_agent", "open_admission", "recv_offer", "resolve_transport",
           "send_request", "sync_message"]
