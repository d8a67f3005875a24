"""Disaggregated serving, one context worker and one generation worker (1P1D).

Rank 0 runs every prompt through its own target cache and, when a request's
first token exists, hands it over: the prompt's tokens, the first token and the
target K/V that the generation worker's window will read. Rank 1 builds the
generation-init caches (`prepare_disagg_gen_init` in both pools) first and
answers with the pages they hold (the page handshake); rank 0 then writes its
own pages onto them in one transfer, through a transfer agent: NIXL over UCX
(`transport="nixl"`, the default when it imports) or torch.distributed
messages (`"torch"`). Rank 1 admits the request when the transfer's
notification arrives, and decodes with the drafter, whose slots are seeded
there because the prompt's drafter context was never computed on it. The
control messages (offer, handshake, end of stream: `disagg_wire.py`) go through
torch.distributed (gloo on CPU, NCCL when each rank has its own GPU); the
pages and the auxiliary bytes through the agent (`disagg_link.py`,
`disagg_pages.py`). A transfer that fails, times out or whose peer is gone
costs that request only: rank 1 releases what it allocated and records why
(`stats.transfer_failures`). Each rank reports to the parent through one queue:
its result (or crash) once, and, when the parent asks for progress, `(steps,
finished, foreign accesses)` after every step it runs, which the parent draws.

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
- **Generation worker.** Before any page moves, the context worker offers the
  request's tokens and the generation worker answers with the prefix its own
  pools published for earlier requests (`find_gen_init_hit`, taken at the
  prompt end) inside its handshake. The transfer then carries target K/V only from
  `max(window start, hit)` per group, and, under `joint`, drafter context only
  from the hit (its draft pool adopts the same pages); under `target` the
  drafter context is sent as before (its draft pool does not reuse). The
  generation init adopts the hit, the tiny target checks the adopted pages
  against the tokens, and once everything is written the prompt's whole pages
  are published (`publish_gen_init`) for later requests.

What each worker does with a request is disagg_transfer.py's; this module runs
the two rank processes and drives them.
"""
from __future__ import annotations

import queue as _queue
import traceback
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from tensorrt_llm_draftkv.request import LlmRequest
from tensorrt_llm_draftkv.transfer import Rendezvous, TransferError
from .disagg_link import PageLink, admit_next, agent_transport, make_agent, resolve_transport, send_request
from .disagg_wire import Channel


class RankProgress(Protocol):
    """Called in the parent after a rank's step: requests that rank finished, its steps, foreign accesses so far.

    Rank 0 (context worker) finishes a request when its prompt is computed and sent; rank 1
    (generation worker) when it has generated every token.
    """

    def __call__(self, rank: int, steps: int, finished: int, foreign: int) -> None: ...


def foreign_accesses(executor) -> int:
    """The executor's drafter's foreign-page accesses so far (0 without a drafter)."""
    return int(getattr(executor.speculator, "foreign_page_accesses", 0) or 0)


def _run_job(rank: int, agent, build: Callable[[int], Any], prompts: list[torch.Tensor], progress: bool,
             queue) -> None:
    """One run on one rank: messages `(rank, "progress", (steps, finished, foreign))` after each
    step when `progress`, then `(rank, "result", value)` once (`{"crash": traceback}` on an error)."""
    try:
        result = build(rank)
        report = None
        if progress:
            def report(ex) -> None:
                queue.put((rank, "progress", (ex.stats.steps, ex.stats.finished, foreign_accesses(ex))))
        if rank == 0:
            queue.put((rank, "result", _context_rank(result, agent, prompts, report)))
        else:
            queue.put((rank, "result", _generation_rank(result, agent, report)))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "result", {"crash": traceback.format_exc()}))


def _worker(rank: int, meet: Rendezvous, backend: str, transport: str, jobs, queue) -> None:
    """One rank process: joins the group and builds its transfer agent once, then runs every job the
    parent sends until None."""
    agent = None
    try:
        dist.init_process_group(backend, init_method=meet.init_method, rank=rank, world_size=2)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        agent = make_agent(transport, rank, meet.tag)
        while (job := jobs.get()) is not None:
            _run_job(rank, agent, *job, queue)
    except BaseException:  # report, never hang the parent
        queue.put((rank, "result", {"crash": traceback.format_exc()}))
    finally:
        if agent is not None:
            agent.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _link(executor, agent) -> PageLink:
    backend = dist.get_backend()
    device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
    channel = Channel(peer=1 - dist.get_rank(), wire_device=device)
    return PageLink.connect(agent, channel, executor, dist.get_rank())


def _context_rank(executor, agent, prompts: list[torch.Tensor], report: Callable[[Any], None] | None = None):
    """The context worker's run; returns its `RunStats` (outputs dropped: only the first tokens)."""
    link = _link(executor, agent)
    midway: list[int] = []  # a request whose round trip an error cut short: the stream cannot be ended cleanly

    def on_complete(req: LlmRequest, ex) -> None:
        midway.append(req.py_request_id)
        try:
            send_request(link, req, ex)
        except TransferError as err:  # the generation worker times out on it and releases it
            ex.stats.transfer_failures[req.py_request_id] = str(err).splitlines()[0]
        midway.pop()

    executor.on_complete = on_complete
    for rid, prompt in enumerate(prompts):
        executor.add_request(rid, prompt)
    try:
        stats = executor.run(progress=None if report is None else lambda steps, finished: report(executor))
    finally:
        if not midway:
            link.channel.send_offer(None)  # the end of the stream
        link.close()
    stats.outputs = {}
    stats.draft_pool_occupancy = []
    stats.transport = agent_transport(agent)
    stats.transfer_bytes, stats.transfer_pages = link.bytes_moved, link.pages_moved
    return stats


def _generation_rank(executor, agent, report: Callable[[Any], None] | None = None):
    link = _link(executor, agent)
    limit = executor.scheduler.config.max_num_requests
    pending, dead = True, False
    try:
        while pending or (executor.scheduler.has_work() and not dead):
            while pending and (dead or len(executor.scheduler.active) < limit):
                pending, dead = admit_next(link, executor, dead)
            if dead or not executor.scheduler.has_work():
                continue
            before = executor.stats.resize_failures
            executor.run_steps(1)
            dead = executor.stats.resize_failures > before
            if report is not None and not dead:
                report(executor)
    finally:
        link.close()
    stats = executor.finish()
    stats.transport = agent_transport(agent)
    return stats


class RankPool:
    """Two rank processes (context worker, generation worker) kept for several runs.

    Spawning a rank and importing torch costs seconds; a scenario of several
    disaggregated runs pays it once. `run` is one run; `close` ends the ranks.
    """

    def __init__(self, backend: str | None = None, transport: str = "auto") -> None:
        import torch.multiprocessing as mp

        self.backend = backend or ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
        self.transport = resolve_transport(transport)  # an engine that cannot import fails here, not in a rank
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(2)]
        self.meet = Rendezvous.create()
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.meet, self.backend, self.transport, self.jobs[r], self.queue))
            for r in range(2)
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
        self.meet.remove()

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
    transport: str = "auto",
):
    """Run both ranks in child processes; returns the generation rank's result.

    `pool`: ranks kept across runs (see `RankPool`); without one, two ranks are
    spawned for this run alone, with `transport` (`auto`, `nixl` or `torch`).
    `progress(rank, steps, finished, foreign)` is called
    here, in the parent, after every step either rank runs.
    """
    if pool is not None:
        return pool.run(build, prompts, progress)
    with RankPool(backend, transport) as own:
        return own.run(build, prompts, progress)
