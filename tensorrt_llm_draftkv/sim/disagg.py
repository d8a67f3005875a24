"""Disaggregated serving, one context worker and one generation worker (1P1D).

Rank 0 runs every prompt through its own target cache and, when a request's
first token exists, hands it over: the prompt's tokens, the first token and the
target K/V that the generation worker's window will read. Rank 1 builds the
generation-init caches (`prepare_disagg_gen_init` in both pools), writes the
received K/V into its own pages and decodes with the drafter, whose slots are
seeded there because the prompt's drafter context was never computed on it.
The two ranks talk through torch.distributed (gloo on CPU, NCCL when each rank
has its own GPU). Per request the context worker offers the tokens, the
generation worker replies with its prefix hit, then the payload follows; an
offer with request_id -1 ends the stream (`disagg_wire.py` has every field). Each
rank reports to the parent through one queue: its result (or crash) once, and,
when the parent asks for progress, `(steps, finished, foreign accesses)` after
every step it runs, which the parent draws.

With the drafter-context handoff (`drafter_handoff="window"`, the default under
`history` sizing) the context worker runs the drafter's context stores too and
sends, beside the target K/V, the drafter context the generation worker's
drafter can still read (`speculative/handoff.py`: the pages the generation-init
mirror backs below the prompt end), plus the drafts its drafter proposed with
the first token. The generation worker checks the context's geometry against
its own, writes it onto exactly those pages through the drafter's checked store,
and seeds the request's first slot with it (`DFlashSpeculator.import_context`).
A context made for another geometry is refused (the request does not run)
unless the worker was told to fall back to the empty seed (`fallback=True`).

Block reuse (`block_reuse` `target`, `target-all` or `joint`; both workers'
pools are built with it):

- **Context worker.** A prompt that hits a prefix an earlier prompt published
  is computed from the hit on; the generation worker learns the hit
  (`reused_tokens`). Without joint reuse its drafter computed only
  `[reused_tokens, m)`, so the drafter context starts there (`drafter_lo`);
  under `joint` its mirror reads the prefix's drafter K/V from shared pages.
- **Generation worker.** Before the payload, the context worker offers the
  request's tokens and the generation worker answers with the prefix its own
  pools published for earlier requests (`find_gen_init_hit`, taken at the
  prompt end). The payload then carries target K/V only from
  `max(window start, hit)` per group, and, under `joint`, drafter context only
  from the hit (its draft pool adopts the same pages); under `target` the
  drafter context is sent as before (its draft pool does not reuse). The
  generation init adopts the hit, the tiny target checks the adopted pages
  against the tokens, and once everything is written the prompt's whole pages
  are published (`publish_gen_init`) for later requests.
"""
from __future__ import annotations

import queue as _queue
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ..manager.gen_init_reuse import receive_start
from ..request import LlmRequest, LlmRequestState
from ..speculative.handoff import DrafterContextMismatch, DrafterHandoff, HandoffForm
from .disagg_wire import (  # noqa: F401 - re-exported: the wire's names were defined here before
    MAX_GROUPS,
    Channel,
    GenHit,
    Offer,
    Transfer,
    clipped_hidden_range,
    clipped_ranges,
    free_port,
    payload_bytes,
    payload_shapes,
)


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


class RankProgress(Protocol):
    """Called in the parent after a rank's step: requests that rank finished, its steps, foreign accesses so far.

    Rank 0 (context worker) finishes a request when its prompt is computed and sent; rank 1
    (generation worker) when it has generated every token.
    """

    def __call__(self, rank: int, steps: int, finished: int, foreign: int) -> None: ...


def foreign_accesses(executor) -> int:
    """The executor's drafter's foreign-page accesses so far (0 without a drafter)."""
    return int(getattr(executor.speculator, "foreign_page_accesses", 0) or 0)


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


def transfer_from(req: LlmRequest, executor, hit: GenHit | None = None) -> Transfer:
    """What the context worker sends for a request whose first token exists (pages still held).

    `hit`: the generation worker's answer (round trip, step 2): target K/V starts
    at `max(window start, hit.tokens)` per group, the drafter context at
    `max(drafter_lo, hit.drafter_tokens)`. With a drafter and `drafter_handoff`
    `window`: also its drafter context (`DFlashSpeculator.export_context`) and the
    drafts it proposed with the first token.
    """
    hit = hit or GenHit(req.py_request_id)
    model = executor.target_model
    rid, m = req.py_request_id, req.prompt_len
    group_lo, keys, values = [], [], []
    for g, group in enumerate(executor.target_manager.layer_groups):
        lo = receive_start(group.life_cycle.window, m, hit.tokens)
        k, v = model.read_kv(rid, lo, m, g)
        group_lo.append(lo)
        keys.append(k)
        values.append(v)
    tokens = torch.tensor(req.tokens[: m + 1], dtype=torch.long)
    item = Transfer(rid, m, tokens, group_lo, keys, values, reused_tokens=req.prepopulated_prompt_len,
                    gen_reused_tokens=hit.tokens, gen_drafter_reused=hit.drafter_tokens)
    settings = handoff_settings(executor)
    if settings.mode is DrafterHandoff.WINDOW:
        speculator = executor.speculator
        geometry = speculator.handoff_geometry(settings.form)
        item.drafter_geometry = geometry
        # Without joint reuse the drafter computed only [reused_tokens, m): nothing below it exists to send.
        if not getattr(executor.draft_manager, "block_reuse", False):
            item.drafter_lo = req.prepopulated_prompt_len
        payload = speculator.export_context(req, executor.tokens[rid], geometry, floor=item.drafter_floor)
        item.drafter_payload = [t.cpu() for t in payload]
        item.drafts = [int(t) for t in (req.py_draft_tokens or [])]
    return item


def hand_over(channel: Channel, req: LlmRequest, executor) -> None:
    """Context worker, a request's first token exists: offer it, learn the generation worker's hit, send."""
    channel.send_offer(offer_for(req))
    hit = channel.recv_reply(req.py_request_id)
    channel.send(transfer_from(req, executor, hit))


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


def _prepare(item: Transfer, executor, req: LlmRequest, take_context: bool) -> None:
    """Both generation-init caches (adopting the announced hits), the adopted pages checked, the drafter
    context written and its slot seeded. All or nothing: on any error every cache and the slot are freed."""
    tm, dm, speculator = executor.target_manager, executor.draft_manager, executor.speculator
    if not tm.prepare_disagg_gen_init(req, reused_tokens=item.gen_reused_tokens):
        raise tm.last_refusal  # False: the pool cannot hold it, and nothing was left behind
    try:
        if dm is not None and not dm.prepare_disagg_gen_init(req, reused_tokens=item.gen_drafter_reused):
            raise dm.last_refusal
        if item.gen_reused_tokens:  # the adopted target pages hold this prompt's K/V (else an error)
            executor.stats.gen_reused_positions_checked += executor.target_model.check_reused(
                req.py_request_id, item.tokens, item.gen_reused_tokens)
        if take_context:
            speculator.import_context(req.py_request_id, item.prompt_len, item.drafter_geometry,
                                      item.drafter_payload, floor=item.drafter_floor, seed_floor=item.drafter_lo)
            if item.gen_drafter_reused:
                speculator.check_adopted_context(req.py_request_id, item.tokens, item.prompt_len, item.drafter_lo,
                                                 item.gen_drafter_reused, item.drafter_geometry)
    except Exception:
        tm.free_resources(req)
        if dm is not None and dm.has_cache(req.py_request_id):
            dm.free_resources(req)
        if speculator is not None:
            speculator.release(req.py_request_id)  # a pending seed, what the checker saw written
        raise


def _count_bytes(item: Transfer, executor, req: LlmRequest, settings: HandoffSettings, take_context: bool) -> None:
    """The handoff's bytes on the wire, and what the same payload would have cost without the round trip."""
    stats, m = executor.stats, item.prompt_len
    row = executor.target_model.config.dim * 2 * executor.target_manager.config.dtype.itemsize  # K + V
    without = sum((m - transfer_range(m, g.life_cycle.window)[0]) * row for g in executor.target_manager.layer_groups)
    sent = item.target_bytes
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


def admit_transfer(item: Transfer, executor) -> LlmRequest:
    """Generation worker: build both generation-init caches, write the received K/V and drafter context.

    With a generation-worker hit (`item.gen_reused_tokens`, answered in the round
    trip) the caches adopt it first; afterwards the prompt's whole pages are
    published (`publish_gen_init`). All or nothing: a refused drafter context
    (`DrafterContextMismatch`) or an admission refusal allocates nothing; a
    failure after the caches exist frees them.
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
    _prepare(item, executor, req, take_context)
    for g, (lo, k, v) in enumerate(zip(item.group_lo, item.keys, item.values)):
        executor.target_model.write_kv_values(req.py_request_id, lo, k, v, groups=[g])
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


def _run_job(rank: int, build: Callable[[int], Any], prompts: list[torch.Tensor], progress: bool, queue) -> None:
    """One run on one rank: messages `(rank, "progress", (steps, finished, foreign))` after each
    step when `progress`, then `(rank, "result", value)` once (`{"crash": traceback}` on an error)."""
    try:
        result = build(rank)
        report = None
        if progress:
            def report(ex) -> None:
                queue.put((rank, "progress", (ex.stats.steps, ex.stats.finished, foreign_accesses(ex))))
        if rank == 0:
            queue.put((rank, "result", _context_rank(result, prompts, report)))
        else:
            queue.put((rank, "result", _generation_rank(result, report)))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "result", {"crash": traceback.format_exc()}))


def _worker(rank: int, port: int, backend: str, jobs, queue) -> None:
    """One rank process: joins the group once, then runs every job the parent sends until None."""
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        while (job := jobs.get()) is not None:
            _run_job(rank, *job, queue)
    except BaseException:  # report, never hang the parent
        queue.put((rank, "result", {"crash": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wire(executor, backend: str) -> Channel:
    device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
    return Channel(
        peer=1 - dist.get_rank(),
        wire_device=device,
        dim=executor.target_model.config.dim,
        dtype=executor.target_manager.config.dtype,
    )


def _context_rank(executor, prompts: list[torch.Tensor], report: Callable[[Any], None] | None = None):
    """The context worker's run; returns its `RunStats` (outputs dropped: only the first tokens)."""
    channel = _wire(executor, dist.get_backend())
    midway: list[int] = []  # a request whose round trip an error cut short: the stream cannot be ended cleanly

    def on_complete(req: LlmRequest, ex) -> None:
        midway.append(req.py_request_id)
        hand_over(channel, req, ex)
        midway.pop()

    executor.on_complete = on_complete
    for rid, prompt in enumerate(prompts):
        executor.add_request(rid, prompt)
    try:
        stats = executor.run(progress=None if report is None else lambda steps, finished: report(executor))
    finally:
        if not midway:
            channel.send_offer(None)  # the end of the stream
    stats.outputs = {}
    stats.draft_pool_occupancy = []
    return stats


def _generation_rank(executor, report: Callable[[Any], None] | None = None):
    channel = _wire(executor, dist.get_backend())
    limit = executor.scheduler.config.max_num_requests
    pending, dead = True, False
    from ..manager import KVCacheResizeError
    from ..manager.admission import AdmissionRefused

    while pending or (executor.scheduler.has_work() and not dead):
        while pending and (dead or len(executor.scheduler.active) < limit):
            offer = channel.recv_offer()
            if offer is None:
                pending = False
                continue
            # The round trip: answer with this worker's hit and read the payload at once (nothing in
            # between changes the pools, so the hit still holds when the caches adopt it).
            channel.send_reply(GenHit(offer.request_id) if dead else generation_hit(offer, executor))
            item = channel.recv(offer)
            if not dead:
                try:
                    admit_transfer(item, executor)
                except (AdmissionRefused, DrafterContextMismatch) as err:
                    executor.refuse(err)  # this request never runs; the others go on
                except KVCacheResizeError as err:
                    # The executor dies here; keep draining so the context worker can finish.
                    executor.stats.resize_failures += 1
                    executor.stats.first_error = executor.stats.first_error or str(err).splitlines()[0]
                    dead = True
        if dead or not executor.scheduler.has_work():
            continue
        before = executor.stats.resize_failures
        executor.run_steps(1)
        dead = executor.stats.resize_failures > before
        if report is not None and not dead:
            report(executor)
    return executor.finish()


class RankPool:
    """Two rank processes (context worker, generation worker) kept for several runs.

    Spawning a rank and importing torch costs seconds; a scenario of several
    disaggregated runs pays it once. `run` is one run; `close` ends the ranks.
    """

    def __init__(self, backend: str | None = None) -> None:
        import torch.multiprocessing as mp

        self.backend = backend or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(2)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, port, self.backend, self.jobs[r], self.queue)) for r in range(2)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, build: Callable[[int], Any], prompts: list[torch.Tensor], progress: RankProgress | None = None):
        """One disaggregated run on the kept ranks; returns the generation rank's result."""
        if self.broken:
            raise RuntimeError("the disaggregated ranks are gone (an earlier run failed)")
        for jobs in self.jobs:
            jobs.put((build, prompts, progress is not None))
        results: dict[int, Any] = {}
        try:
            while len(results) < 2:
                rank, kind, value = self._next(results)
                if kind == "progress":
                    if progress is not None:
                        progress(rank, *value)
                    continue
                results[rank] = value
                if isinstance(value, dict) and "crash" in value:
                    raise RuntimeError(f"disaggregated rank {rank} crashed:\n{value['crash']}")
        except BaseException:
            self.broken = True
            self.close(force=True)
            raise
        if results[0] is not None and hasattr(results[1], "context_worker"):
            results[1].context_worker = results[0]  # its pools' state at the end, its prefix checks
        return results[1]

    def _next(self, results: dict[int, Any]):
        while True:
            try:
                return self.queue.get(timeout=1.0)
            except _queue.Empty:
                # A rank that died before reporting would leave the parent waiting forever;
                # a rank that did report has flushed its result first, so try the pipe once more.
                gone = [r for r, p in enumerate(self.procs) if r not in results and p.exitcode is not None]
                if not gone:
                    continue
                try:
                    return self.queue.get(timeout=5.0)
                except _queue.Empty:
                    codes = {r: self.procs[r].exitcode for r in gone}
                    raise RuntimeError(
                        f"disaggregated rank(s) {gone} exited without reporting (exit codes {codes})"
                    ) from None

    def close(self, force: bool = False) -> None:
        for p, jobs in zip(self.procs, self.jobs):
            if force and p.is_alive():
                p.terminate()  # its peer is gone: it would wait on the wire forever
            elif p.is_alive():
                jobs.put(None)
        for p in self.procs:
            p.join()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        if not self.broken:
            self.close()


def run_disaggregated(
    build: Callable[[int], Any],
    prompts: list[torch.Tensor],
    *,
    backend: str | None = None,
    progress: RankProgress | None = None,
    pool: RankPool | None = None,
):
    """Run both ranks in child processes; returns the generation rank's result.

    `pool`: ranks kept across runs (see `RankPool`); without one, two ranks are
    spawned for this run alone. `progress(rank, steps, finished, foreign)` is called
    here, in the parent, after every step either rank runs.
    """
    if pool is not None:
        return pool.run(build, prompts, progress)
    with RankPool(backend) as own:
        return own.run(build, prompts, progress)
