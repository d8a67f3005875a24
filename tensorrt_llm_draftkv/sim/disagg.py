"""Disaggregated serving, one context worker and one generation worker (1P1D).

Rank 0 runs every prompt through its own target cache and, when a request's
first token exists, sends the prompt's tokens, the first token and the target
K/V that the generation worker's window will read. Rank 1 builds the
generation-init caches (`prepare_disagg_gen_init` in both pools), writes the
received K/V into its own pages and decodes with the drafter, whose slots are
seeded there because the prompt's drafter context was never computed on it.
The two ranks talk through torch.distributed (gloo on CPU, NCCL when each rank
has its own GPU). Each rank reports to the parent through one queue: its result
(or crash) once, and, when the parent asks for progress, `(steps, finished,
foreign accesses)` after every step it runs, which the parent draws.

With the drafter-context handoff (`drafter_handoff="window"`, the default under
`history` sizing) the context worker runs the drafter's context stores too and
sends, beside the target K/V, the drafter context the generation worker's
drafter can still read (`speculative/handoff.py`: the pages the generation-init
mirror backs below the prompt end), plus the drafts its drafter proposed with
the first token. The generation worker checks the context's geometry against
its own, writes it onto exactly those pages through the drafter's checked store,
and seeds the request's first slot with it (`DFlashSpecMetadata.seed_context`).
A context made for another geometry is refused (the request does not run)
unless the worker was told to fall back to the empty seed (`fallback=True`).

With block reuse on the context worker (`block_reuse` `target` or `joint`), a
prompt that hits a prefix an earlier prompt published is computed from the hit
on; the generation worker learns the hit (`reused_tokens`) from the header. Under
`target` reuse the context worker's drafter computed only `[reused_tokens, m)`,
so the drafter context sent starts there (`drafter_lo`); under `joint` reuse its
mirror reads the prefix's drafter K/V from the shared pages and the whole window
is sent. The generation worker's pools do not reuse.

Wire format per request: an int64 header `[request_id, prompt_len, num_tokens,
num_groups, num_drafts, drafter_context, reused_tokens, drafter_lo, lo_0, ..]`,
the token ids, K and V of positions `[lo_g, prompt_len)` for each target layer
group g, the draft tokens (when num_drafts > 0), then, when drafter_context is
1, the drafter context: its geometry header (`DrafterContextGeometry.to_wire`,
version first) and its tensors, shaped by that header and clipped to start at
`drafter_lo` or later (form `kv`: `[n_g, layers_g, 2, heads, head_dim]` per
draft group; form `hidden`: one `[n, hidden_size]`). A header with request_id
-1 ends the stream.
"""
from __future__ import annotations

import queue as _queue
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from ..request import LlmRequest, LlmRequestState
from ..speculative.handoff import (
    HEADER_INTS,
    DrafterContextGeometry,
    DrafterContextMismatch,
    DrafterHandoff,
    HandoffForm,
)

MAX_GROUPS = 8
_FIXED = 8  # header ints before the per-group `lo_g`
_HEADER = _FIXED + MAX_GROUPS


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


@dataclass
class Transfer:
    """One request from the context worker: tokens, target K/V of `[group_lo[g], prompt_len)`, and optionally
    the drafts and the drafter context (`drafter_geometry` describes `drafter_payload`)."""

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
    drafter_lo: int = 0  # the drafter context sent starts at this position or later (see `clipped_ranges`)

    @property
    def drafter_bytes(self) -> int:
        """Bytes of the drafter context on the wire (0 without one)."""
        return sum(t.numel() * t.element_size() for t in self.drafter_payload)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Channel:
    """Point-to-point transfers between the two ranks; tensors travel on the wire device."""

    def __init__(self, peer: int, wire_device: torch.device, dim: int, dtype: torch.dtype) -> None:
        self.peer = peer
        self.wire = wire_device
        self.dim = dim
        self.dtype = dtype

    def send(self, item: Transfer | None) -> None:
        header = torch.full((_HEADER,), -1, dtype=torch.long)
        if item is not None:
            header[:_FIXED] = torch.tensor([
                item.request_id, item.prompt_len, item.tokens.numel(), len(item.group_lo), len(item.drafts),
                int(item.drafter_geometry is not None), item.reused_tokens, item.drafter_lo,
            ])
            header[_FIXED : _FIXED + len(item.group_lo)] = torch.tensor(item.group_lo)
        dist.send(header.to(self.wire), self.peer)
        if item is None:
            return
        dist.send(item.tokens.to(self.wire, torch.long).contiguous(), self.peer)
        for k, v in zip(item.keys, item.values):
            dist.send(k.to(self.wire, self.dtype).contiguous(), self.peer)
            dist.send(v.to(self.wire, self.dtype).contiguous(), self.peer)
        if item.drafts:
            dist.send(torch.tensor(item.drafts, dtype=torch.long, device=self.wire), self.peer)
        if item.drafter_geometry is not None:
            geometry = item.drafter_geometry
            dist.send(torch.tensor(geometry.to_wire(), dtype=torch.long, device=self.wire), self.peer)
            shapes = payload_shapes(geometry, item.prompt_len, item.drafter_lo)
            for t, (shape, dtype) in zip(item.drafter_payload, shapes):
                if tuple(t.shape) != shape:
                    raise ValueError(
                        f"request {item.request_id}: drafter context tensor {tuple(t.shape)}, the header says {shape}"
                    )
                dist.send(t.to(self.wire, dtype).contiguous(), self.peer)

    def recv(self) -> Transfer | None:
        header = torch.empty(_HEADER, dtype=torch.long, device=self.wire)
        dist.recv(header, self.peer)
        header = header.cpu()
        if int(header[0]) < 0:
            return None
        rid, prompt_len, num_tokens, num_groups, num_drafts, has_ctx, reused, drafter_lo = (
            int(x) for x in header[:_FIXED]
        )
        group_lo = [int(x) for x in header[_FIXED : _FIXED + num_groups]]
        tokens = torch.empty(num_tokens, dtype=torch.long, device=self.wire)
        dist.recv(tokens, self.peer)
        keys, values = [], []
        for lo in group_lo:
            k = torch.empty(prompt_len - lo, self.dim, dtype=self.dtype, device=self.wire)
            v = torch.empty_like(k)
            dist.recv(k, self.peer)
            dist.recv(v, self.peer)
            keys.append(k)
            values.append(v)
        item = Transfer(rid, prompt_len, tokens, group_lo, keys, values, reused_tokens=reused, drafter_lo=drafter_lo)
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
            for shape, dtype in payload_shapes(geometry, prompt_len, drafter_lo):
                t = torch.empty(shape, dtype=dtype, device=self.wire)
                dist.recv(t, self.peer)
                item.drafter_payload.append(t)
        return item


def transfer_range(prompt_len: int, window: int | None) -> tuple[int, int]:
    """Absolute positions `[lo, prompt_len)` of target K/V the generation worker reads.

    Its first query sits at position m = prompt_len and attends `[m + 1 - W, m]`;
    position m itself is computed there. So exactly `[max(0, m + 1 - W), m)` is
    sent, all of the prompt for full attention. Sending one position more (from
    `m - W`) would write onto a page the generation-init cache (history m) has
    already released whenever `m + 1 - W` starts a page.
    """
    if window is None:
        return 0, prompt_len
    return max(0, prompt_len + 1 - window), prompt_len


def handoff_settings(executor) -> HandoffSettings:
    """The worker's handoff settings (`executor.drafter_handoff`); none without a drafter."""
    settings = getattr(executor, "drafter_handoff", None)
    if settings is None or executor.speculator is None or not hasattr(executor.speculator, "handoff_geometry"):
        return NO_HANDOFF
    return settings


def transfer_from(req: LlmRequest, executor) -> Transfer:
    """What the context worker sends for a request whose first token exists (pages still held).

    With a drafter and `drafter_handoff` `window`: also its drafter context
    (`DFlashSpeculator.export_context`) and the drafts it proposed with the first token.
    """
    model = executor.target_model
    rid, m = req.py_request_id, req.prompt_len
    group_lo, keys, values = [], [], []
    for g, group in enumerate(executor.target_manager.layer_groups):
        lo, _ = transfer_range(m, group.life_cycle.window)
        k, v = model.read_kv(rid, lo, m, g)
        group_lo.append(lo)
        keys.append(k)
        values.append(v)
    tokens = torch.tensor(req.tokens[: m + 1], dtype=torch.long)
    item = Transfer(rid, m, tokens, group_lo, keys, values, reused_tokens=req.reused_tokens)
    settings = handoff_settings(executor)
    if settings.mode is DrafterHandoff.WINDOW:
        speculator = executor.speculator
        geometry = speculator.handoff_geometry(settings.form)
        item.drafter_geometry = geometry
        # Without joint reuse the drafter computed only [reused_tokens, m): nothing below it exists to send.
        if not getattr(executor.draft_manager, "block_reuse", False):
            item.drafter_lo = req.reused_tokens
        payload = speculator.export_context(req, executor.tokens[rid], geometry, floor=item.drafter_lo)
        item.drafter_payload = [t.cpu() for t in payload]
        item.drafts = [int(t) for t in (req.py_draft_tokens or [])]
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


def admit_transfer(item: Transfer, executor) -> LlmRequest:
    """Generation worker: build both generation-init caches, write the received K/V and drafter context.

    All or nothing: a refused drafter context (`DrafterContextMismatch`) or an
    admission refusal allocates nothing; a failure after the caches exist frees them.
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
    executor.target_manager.prepare_disagg_gen_init(req)
    try:
        if executor.draft_manager is not None:
            executor.draft_manager.prepare_disagg_gen_init(req)
        if take_context:
            executor.speculator.import_context(req.py_request_id, item.prompt_len, item.drafter_geometry,
                                               item.drafter_payload, floor=item.drafter_lo)
    except Exception:
        executor.target_manager.free_resources(req)
        if executor.draft_manager is not None and executor.draft_manager.has_cache(req.py_request_id):
            executor.draft_manager.free_resources(req)
        if executor.speculator is not None:
            executor.speculator.release(req.py_request_id)  # a pending seed, what the checker saw written
        raise
    for g, (lo, k, v) in enumerate(zip(item.group_lo, item.keys, item.values)):
        executor.target_model.write_kv_values(req.py_request_id, lo, k, v, groups=[g])
    if hasattr(executor.speculator, "handoff_geometry") and executor.draft_manager is not None:
        own = executor.speculator.handoff_geometry(settings.form)
        full = own.payload_bytes(item.prompt_len, whole_prompt=True)
        sent = item.drafter_bytes if take_context else 0
        executor.stats.full_drafter_bytes += full
        executor.stats.drafter_bytes_sent += sent
        executor.stats.drafter_bytes_by_request[req.py_request_id] = (item.prompt_len, sent, full)
    executor.stats.reused_tokens[req.py_request_id] = item.reused_tokens  # the context worker's prefix hit
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
    executor.on_complete = lambda req, ex: channel.send(transfer_from(req, ex))
    for rid, prompt in enumerate(prompts):
        executor.add_request(rid, prompt)
    try:
        stats = executor.run(progress=None if report is None else lambda steps, finished: report(executor))
    finally:
        channel.send(None)
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
            item = channel.recv()
            if item is None:
                pending = False
            elif not dead:
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
