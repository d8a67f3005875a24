"""What a request carries between the disaggregated workers, and what each does with it.

The context worker builds a request's `Offer` (its prompt and first token) and
its `Transfer` for the generation worker's hit (`transfer_plan`: ranges,
drafts, drafter geometry; `transfer_from` adds the K/V and drafter context as
tensors, for in-process use). The generation worker admits a request in two
steps around the bytes' arrival: `begin_admission` (checks, both
generation-init caches) and `finish_admission` (the drafter's first slot, the
target K/V unless a transfer engine already wrote it, publishing);
`release_admission` undoes the first when the bytes never come;
`admit_transfer` is both with a whole `Transfer` in hand. Positions are
absolute token positions of the request (`[lo, prompt_len)` ranges); pages are
the receiving worker's own. disagg_link.py moves the bytes, disagg.py runs the
two workers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm_draftkv.manager.gen_init_reuse import receive_start
from tensorrt_llm_draftkv.request import LlmRequest, LlmRequestState
from tensorrt_llm_draftkv.speculative.handoff import DrafterContextMismatch, DrafterHandoff, HandoffForm
from .disagg_wire import GenHit, Offer, Transfer, payload_bytes


@dataclass(frozen=True)
class HandoffSettings:
    """A worker's drafter-context handoff: what the context worker sends, what the generation worker takes.

    `mode`: `window` (send / take the readable drafter context) or `none`
    (nothing; an empty seed). `form`: what the context worker sends (`kv` or
    `hidden`). `fallback`: a generation worker that receives a context made for
    another geometry seeds an empty slot instead of refusing the request.
    """

    mode: DrafterHandoff = DrafterHandoff.WINDOW
    form: HandoffForm = HandoffForm.KV
    fallback: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", DrafterHandoff.parse(self.mode))
        object.__setattr__(self, "form", HandoffForm.parse(self.form))


NO_HANDOFF = HandoffSettings(DrafterHandoff.NONE)


def transfer_range(prompt_len: int, window: int | None) -> tuple[int, int]:
    """Absolute positions `[lo, prompt_len)` of target K/V the generation worker reads.

    Its first query sits at position m = prompt_len and attends `[m + 1 - W, m]`;
    position m itself is computed there. So exactly `[max(0, m + 1 - W), m)` is
    sent, all of the prompt for full attention. Sending one position more (from
    `m - W`) would write onto a page the generation-init cache (history m) has
    already released whenever `m + 1 - W` starts a page. A generation worker's
    prefix hit raises the start further (`manager.gen_init_reuse.receive_start`).
    """
    return receive_start(window, prompt_len), prompt_len


def handoff_settings(executor) -> HandoffSettings:
    """The worker's handoff settings (`executor.drafter_handoff`); none without a drafter."""
    settings = getattr(executor, "drafter_handoff", None)
    if settings is None or executor.speculator is None or not hasattr(executor.speculator, "handoff_geometry"):
        return NO_HANDOFF
    return settings


def offer_for(req: LlmRequest) -> Offer:
    """Round trip, step 1: the request's prompt and first token."""
    return Offer(req.py_request_id, req.prompt_len, torch.tensor(req.tokens[: req.prompt_len + 1], dtype=torch.long))


def generation_hit(offer: Offer, executor) -> GenHit:
    """Round trip, step 2 (generation worker): the prefix its pools hold for this prompt. Changes nothing.

    `tokens`: `find_gen_init_hit` of the target manager (joint with the draft
    pool when paired); `drafter_tokens`: the same hit when the draft pool
    adopts it too (joint reuse), else 0.
    """
    tm, dm = executor.target_manager, executor.draft_manager
    if not tm.block_reuse:
        return GenHit(offer.request_id)
    req = LlmRequest(offer.request_id, prompt_len=offer.prompt_len, tokens=offer.tokens.tolist(),
                     state=LlmRequestState.DISAGG_GENERATION_INIT)
    hit = tm.find_gen_init_hit(req)
    joint = dm is not None and dm.block_reuse and tm.is_paired_with(dm)
    return GenHit(offer.request_id, hit, hit if joint else 0)


def transfer_plan(req: LlmRequest, executor, hit: GenHit | None = None) -> Transfer:
    """What the context worker sends for a request, without the K/V tensors: the ranges, the drafts, the
    drafter context's geometry and floor (the page path writes the pages themselves)."""
    hit = hit or GenHit(req.py_request_id)
    rid, m = req.py_request_id, req.prompt_len
    group_lo = [receive_start(g.life_cycle.window, m, hit.tokens) for g in executor.target_manager.layer_groups]
    tokens = torch.tensor(req.tokens[: m + 1], dtype=torch.long)
    item = Transfer(rid, m, tokens, group_lo, [], [], reused_tokens=req.prepopulated_prompt_len,
                    gen_reused_tokens=hit.tokens, gen_drafter_reused=hit.drafter_tokens)
    settings = handoff_settings(executor)
    if settings.mode is DrafterHandoff.WINDOW:
        item.drafter_geometry = executor.speculator.handoff_geometry(settings.form)
        # Without joint reuse the drafter computed only [reused_tokens, m): nothing below it exists to send.
        if not getattr(executor.draft_manager, "block_reuse", False):
            item.drafter_lo = req.prepopulated_prompt_len
        item.drafts = [int(t) for t in (req.py_draft_tokens or [])]
    return item


def transfer_from(req: LlmRequest, executor, hit: GenHit | None = None) -> Transfer:
    """What the context worker sends for a request whose first token exists (pages still held).

    `hit`: the generation worker's answer (round trip, step 2): target K/V starts
    at `max(window start, hit.tokens)` per group, the drafter context at
    `max(drafter_lo, hit.drafter_tokens)`. With a drafter and `drafter_handoff`
    `window`: also its drafter context (`DFlashSpeculator.export_context`) and the
    drafts it proposed with the first token.
    """
    item = transfer_plan(req, executor, hit)
    for g, lo in enumerate(item.group_lo):
        k, v = executor.target_model.read_kv(item.request_id, lo, item.prompt_len, g)
        item.keys.append(k)
        item.values.append(v)
    if item.drafter_geometry is not None:
        payload = executor.speculator.export_context(req, executor.tokens[item.request_id], item.drafter_geometry,
                                                     floor=item.drafter_floor)
        item.drafter_payload = [t.cpu() for t in payload]
    return item


def _accepted_context(item: Transfer, executor, settings: HandoffSettings) -> bool:
    """Does this generation worker take the item's drafter context? Checked before anything is allocated.

    Raises `DrafterContextMismatch` (naming both geometries) for a context made
    for another geometry, unless `settings.fallback` (then it is dropped, counted,
    and the slot gets the empty seed).
    """
    if item.drafter_geometry is None or settings.mode is not DrafterHandoff.WINDOW:
        return False
    expected = executor.speculator.handoff_geometry(item.drafter_geometry.form)
    try:
        expected.check_compatible(item.drafter_geometry, request_id=item.request_id)
    except DrafterContextMismatch as err:
        if not settings.fallback:
            raise
        executor.stats.handoff_fallbacks += 1
        executor.stats.first_error = executor.stats.first_error or str(err).splitlines()[0]
        return False
    return True


@dataclass
class Admission:
    """A request the generation worker has built both generation-init caches for (`begin_admission`),
    waiting for its bytes; `finish_admission` makes it decode, `release_admission` gives everything back."""

    item: Transfer
    req: LlmRequest
    settings: HandoffSettings
    take_context: bool


def begin_admission(item: Transfer, executor) -> Admission:
    """Generation worker, before any byte of the request arrives: check it, build both generation-init caches
    (adopting the announced hits). Needs only `item`'s header fields (tokens, ranges, geometry, hits).

    All or nothing: a refused drafter context (`DrafterContextMismatch`) or an admission refusal allocates
    nothing; a pool that cannot hold it raises the manager's refusal with nothing left behind.
    """
    settings = handoff_settings(executor)
    take_context = _accepted_context(item, executor, settings)
    req = LlmRequest(
        item.request_id,
        prompt_len=item.prompt_len,
        tokens=item.tokens.cpu().tolist(),
        state=LlmRequestState.DISAGG_GENERATION_INIT,
        max_new_tokens=executor.max_new_tokens,
    )
    executor.check_admission(req)
    tm, dm = executor.target_manager, executor.draft_manager
    if not tm.prepare_disagg_gen_init(req, reused_tokens=item.gen_reused_tokens):
        raise tm.last_refusal  # False: the pool cannot hold it, and nothing was left behind
    admission = Admission(item, req, settings, take_context)
    if dm is not None and not dm.prepare_disagg_gen_init(req, reused_tokens=item.gen_drafter_reused):
        release_admission(admission, executor)
        raise dm.last_refusal
    return admission


def release_admission(admission: Admission, executor) -> None:
    """Give back everything `begin_admission` (and a failed `finish_admission`) took: both caches, the slot."""
    req, dm, speculator = admission.req, executor.draft_manager, executor.speculator
    if executor.target_manager.has_cache(req.py_request_id):
        executor.target_manager.free_resources(req)
    if dm is not None and dm.has_cache(req.py_request_id):
        dm.free_resources(req)
    if speculator is not None:
        speculator.release(req.py_request_id)  # a pending seed, what the checker saw written


def _seed(admission: Admission, executor) -> None:
    """The adopted pages checked, the drafter context written through the checked store, its slot seeded."""
    item, req, speculator = admission.item, admission.req, executor.speculator
    if item.gen_reused_tokens:  # the adopted target pages hold this prompt's K/V (else an error)
        executor.stats.gen_reused_positions_checked += executor.target_model.check_reused(
            req.py_request_id, item.tokens, item.gen_reused_tokens)
    if admission.take_context:
        speculator.import_context(req.py_request_id, item.prompt_len, item.drafter_geometry,
                                  item.drafter_payload, floor=item.drafter_floor, seed_floor=item.drafter_lo)
        if item.gen_drafter_reused:
            speculator.check_adopted_context(req.py_request_id, item.tokens, item.prompt_len, item.drafter_lo,
                                             item.gen_drafter_reused, item.drafter_geometry)


def _count_bytes(item: Transfer, executor, req: LlmRequest, settings: HandoffSettings, take_context: bool) -> None:
    """The handoff's bytes (target K/V of one layer per group and the drafter context, as the rows the
    generation worker reads), and what the same payload would have cost without the round trip."""
    stats, m = executor.stats, item.prompt_len
    row = executor.target_model.config.dim * 2 * executor.target_manager.config.dtype.itemsize  # K + V
    without = sum((m - transfer_range(m, g.life_cycle.window)[0]) * row for g in executor.target_manager.layer_groups)
    sent = sum((m - lo) * row for lo in item.group_lo)
    if hasattr(executor.speculator, "handoff_geometry") and executor.draft_manager is not None:
        own = executor.speculator.handoff_geometry(settings.form)
        full = own.payload_bytes(m, whole_prompt=True)
        drafter = item.drafter_bytes if take_context else 0
        stats.full_drafter_bytes += full
        stats.drafter_bytes_sent += drafter
        stats.drafter_bytes_by_request[req.py_request_id] = (m, drafter, full)
        sent += item.drafter_bytes
        if item.drafter_geometry is not None:
            without += payload_bytes(item.drafter_geometry, m, item.drafter_lo)
    stats.handoff_bytes_sent += sent
    stats.handoff_bytes_without_gen_reuse += without


def finish_admission(admission: Admission, executor, *, target_written: bool = False) -> LlmRequest:
    """Generation worker, every byte of the request received: seed the drafter, write the target K/V (unless
    the transfer engine already put it on the pages, `target_written`), publish, and start decoding.

    On an error everything `begin_admission` took is given back before it propagates.
    """
    item, req, settings, take_context = admission.item, admission.req, admission.settings, admission.take_context
    try:
        _seed(admission, executor)
        if not target_written:
            for g, (lo, k, v) in enumerate(zip(item.group_lo, item.keys, item.values)):
                executor.target_model.write_kv_values(req.py_request_id, lo, k, v, groups=[g])
    except Exception:
        release_admission(admission, executor)
        raise
    executor.target_manager.publish_gen_init(req)
    if take_context and executor.draft_manager is not None:
        executor.draft_manager.publish_gen_init(req, written_from=item.drafter_floor)
    _count_bytes(item, executor, req, settings, take_context)
    executor.stats.reused_tokens[req.py_request_id] = item.reused_tokens  # the context worker's prefix hit
    executor.stats.gen_reused_tokens[req.py_request_id] = item.gen_reused_tokens
    if take_context:
        # The context worker's drafter proposed these with the first token, from the same context.
        req.py_draft_tokens = list(item.drafts[: executor.scheduler.config.max_draft_len])
    req.state = LlmRequestState.GENERATION_IN_PROGRESS  # the transfer is complete: it decodes now
    executor.add_generation_request(req, item.tokens)
    return req


def admit_transfer(item: Transfer, executor) -> LlmRequest:
    """Generation worker, a whole `Transfer` in hand: build both generation-init caches, write the received
    K/V and drafter context (`begin_admission`, then `finish_admission`).

    With a generation-worker hit (`item.gen_reused_tokens`, answered in the round
    trip) the caches adopt it first; afterwards the prompt's whole pages are
    published (`publish_gen_init`). All or nothing: a refused drafter context
    (`DrafterContextMismatch`) or an admission refusal allocates nothing; a
    failure after the caches exist frees them.
    """
    return finish_admission(begin_admission(item, executor), executor)
