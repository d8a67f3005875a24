"""The one executor loop: schedule, size, forward, verify, commit, propose, update, complete.

Per step: the scheduler picks context chunks and generation requests (or the
caller hands the batch); the verifier's target manager and (under
`request_context(is_draft=True)`) the draft manager size every cache, warmup
dummies joining the draft rows; the drafter maps rows to slots; context chunks
go through the verifier (target K/V, the first output token) into the
drafter's context; generation rows verify the last drafts greedily
(`verify.py`: the tiny target or a ground-truth oracle); the drafter commits
the verified tokens (optimistic rows commit all, then roll back) and proposes;
the managers advance history; finished requests free every page. Positions
are absolute. A resize failure ends the run, as it kills a real executor.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Protocol, Sequence

import torch

from tensorrt_llm_draftkv.manager import KVCacheManagerV2, KVCacheResizeError
from tensorrt_llm_draftkv.manager.admission import AdmissionRefused
from tensorrt_llm_draftkv.manager.rules import MirrorSizing
from tensorrt_llm_draftkv.request import LlmRequest, LlmRequestState, ScheduledRequests, request_context
from .scheduler import Scheduler
from .stats import SPECULATOR_COUNTERS, RunStats
from .target_model import TinyTarget
from .verify import TargetVerifier, Verifier


class Speculator(Protocol):
    """What the loop needs from a drafter (see speculator.py's DFlashSpeculator)."""

    foreign_page_accesses: int

    def prepare(self, batch: ScheduledRequests) -> None: ...

    def store_context(self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int) -> None: ...

    def store_verified(
        self, req: LlmRequest, tokens: torch.Tensor, preds: Sequence[int], keep: int, *, optimistic: bool = False
    ) -> None: ...

    def propose(self, reqs: list[LlmRequest], tokens: dict[int, torch.Tensor]) -> dict[int, list[int]]: ...

    def release(self, request_id: int) -> None: ...


@dataclass
class StepResult:
    """What one step did, by request id (positions absolute)."""

    accepted: dict[int, int]  # generation request -> drafts accepted this step
    drafted: dict[int, int]  # generation request -> drafts verified this step
    drafts: dict[int, list[int]]  # generating request -> drafts proposed for the next step


class Executor:
    """Drives requests through a verifier (the tiny target by default), an optional draft manager and drafter.

    Give either `target_manager` and `target_model` (greedy verification by the
    tiny target) or a `verifier` (e.g. `TruthVerifier`: no target at all).
    """

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        max_new_tokens: int,
        target_manager: KVCacheManagerV2 | None = None,
        target_model: TinyTarget | None = None,
        verifier: Verifier | None = None,
        draft_manager: KVCacheManagerV2 | None = None,
        speculator: Speculator | None = None,
        on_step: Callable[["Executor"], None] | None = None,
        on_complete: Callable[[LlmRequest, "Executor"], None] | None = None,
    ) -> None:
        if verifier is None:
            if target_manager is None or target_model is None:
                raise ValueError("an executor needs a target manager and model, or a verifier")
            verifier = TargetVerifier(target_manager, target_model)
        elif target_manager is not None or target_model is not None:
            raise ValueError("give a verifier or a target manager and model, not both")
        self.verifier = verifier
        self.scheduler = scheduler
        self.max_new_tokens = max_new_tokens
        self.draft_manager = draft_manager
        self.speculator = speculator
        self.on_step = on_step
        self.on_complete = on_complete
        #: disaggregated workers only: the drafter-context handoff (`disagg_transfer.HandoffSettings`); None = none
        self.drafter_handoff = None
        self.tokens: dict[int, torch.Tensor] = {}
        self.stats = RunStats()
        self._started: float | None = None
        self._next_dummy = 1 << 40  # ids of the warmup dummies that join a step's draft rows
        pools = [m for m in (verifier.manager, draft_manager) if m is not None]
        self._device = pools[0].config.device if pools else "cpu"

    @property
    def target_manager(self) -> KVCacheManagerV2 | None:
        return self.verifier.manager

    @property
    def target_model(self) -> TinyTarget | None:
        return self.verifier.model

    # -- requests ---------------------------------------------------------------
    def _buffer(self, tokens: torch.Tensor, room: int | None = None) -> torch.Tensor:
        """Token ids on the device with `room` more slots (default: every generated and draft token)."""
        if room is None:
            room = self.max_new_tokens + self.scheduler.config.max_draft_len + 2
        buf = torch.zeros(tokens.numel() + room, dtype=torch.long, device=self._device)
        buf[: tokens.numel()] = tokens.to(self._device)
        return buf

    def add_request(self, request_id: int, prompt: torch.Tensor) -> LlmRequest | None:
        """Admit a new request; one whose draft mirror the pool's charge does not cover is refused.

        A refusal (`AdmissionRefused`, with the numbers) happens before anything is
        allocated: the request never runs, is counted and returns None, and no later
        resize can fail for it.
        """
        req = LlmRequest(
            request_id, prompt_len=int(prompt.numel()), tokens=prompt.tolist(), max_new_tokens=self.max_new_tokens
        )
        try:
            self.check_admission(req)
        except AdmissionRefused as err:
            self.refuse(err)
            return None
        self.tokens[request_id] = self._buffer(prompt)
        self.scheduler.add(req)
        return req

    def check_admission(self, req: LlmRequest) -> None:
        """The draft manager's admission check against the charge its pool was sized with.

        Not under the `legacy` sizing: the pre-fix executor admitted every request,
        and its runs exist to show the resize failure that followed.
        """
        dm = self.draft_manager
        if dm is None or not hasattr(dm, "check_admission") or dm.sizing is MirrorSizing.LEGACY:
            return
        dm.check_admission(req, chunk=self.scheduler.config.chunk_size)

    def refuse(self, err: Exception) -> None:
        """A request refused before anything was allocated (admission, or a drafter context it cannot take)."""
        self.stats.refused_requests += 1
        self.stats.first_error = self.stats.first_error or str(err).splitlines()[0]

    def track(self, req: LlmRequest, tokens: torch.Tensor, *, room: int | None = None) -> None:
        """Serve a request the caller built (views, caches): active now, no admission check.

        `tokens`: the ids it holds; `room`: buffer slots past them (default: see `_buffer`).
        """
        self.tokens[req.py_request_id] = self._buffer(tokens, room)
        self.scheduler.active.append(req)

    #: A request whose prompt was computed elsewhere (disaggregated generation worker).
    add_generation_request = track

    # -- warmup -------------------------------------------------------------------
    def _dummies(self, manager: KVCacheManagerV2, ids: list[int], sizes: Sequence[int]) -> list[LlmRequest]:
        """Generation dummies of `sizes` tokens; `history_hint` lets a windowed pool back only their window."""
        made = manager.add_dummy_requests(
            ids,
            list(sizes),
            is_gen=True,
            max_num_draft_tokens=self.scheduler.config.max_draft_len,
            history_hint=max(sizes) - 1,
        )
        if made is None:  # upstream's answer to a pool that cannot hold them: the reason is kept
            raise manager.last_refusal
        return made

    def warmup(self, num_dummies: int, token_num: int) -> bool:
        """CUDA-graph-style warmup: generation dummies of `token_num` tokens in both pools, then freed.

        A warmup the draft pool cannot hold is skipped and counted, as an
        executor would skip that graph; returns whether it ran.
        """
        ids = [-(i + 1) for i in range(num_dummies)]
        made: list[tuple[KVCacheManagerV2, LlmRequest]] = []
        try:
            for manager in (self.target_manager, self.draft_manager):
                if manager is not None:
                    made.extend((manager, d) for d in self._dummies(manager, ids, [token_num] * num_dummies))
        except KVCacheResizeError:
            self.stats.skipped_warmups += 1
            return False
        finally:
            for manager, dummy in made:
                manager.free_resources(dummy)
        return True

    # -- the loop -------------------------------------------------------------------
    def run(self, progress: Callable[[int, int], None] | None = None) -> RunStats:
        """Step until every request finished or a resize failure killed the run."""
        while self.scheduler.has_work():
            if not self.run_steps(1):
                break
            if progress is not None:
                progress(self.stats.steps, self.stats.finished)
        return self.finish()

    def run_steps(self, count: int) -> bool:
        """Run up to `count` steps; False once a resize failure has ended the run."""
        if self._started is None:
            self._started = time.perf_counter()
        try:
            for _ in range(count):
                if not self.scheduler.has_work():
                    break
                self.step()
        except KVCacheResizeError as err:
            self.stats.resize_failures += 1
            self.stats.first_error = self.stats.first_error or str(err).splitlines()[0]
            return False
        return True

    def finish(self) -> RunStats:
        if self._started is not None:
            self.stats.wall_s = time.perf_counter() - self._started
        self.stats.reused_positions_checked = getattr(self.verifier, "reused_positions_checked", 0)
        if not self.scheduler.has_work():
            self.check_pools_idle()
        if self.speculator is not None:
            for name in SPECULATOR_COUNTERS:
                setattr(self.stats, name, getattr(self.speculator, name, 0))
        return self.stats

    def step(
        self,
        batch: ScheduledRequests | None = None,
        *,
        chunks: Mapping[int, int] | None = None,
        optimistic: Collection[int] | None = None,
        dummy_tokens: Sequence[int] = (),
    ) -> StepResult:
        """One step over the scheduler's batch, or over `batch` as given (no budget).

        `chunks`: each context request's next chunk size (absent: the rest of its
        prompt; `None`: the scheduler's chunk size). `optimistic`: generation
        requests that commit every verified token (one trial commit of the batch,
        the others at their accepted tokens), then roll back to the accepted ones
        (`None`: those that rejected a verified token). `dummy_tokens`: one warmup
        dummy per entry, of that many tokens, joins the draft rows for the step.
        """
        if batch is None:
            batch = self._schedule()
        dummies: list[LlmRequest] = []
        if dummy_tokens:
            if self.draft_manager is None:
                raise ValueError("warmup dummies in a step need a draft manager")
            ids = list(range(self._next_dummy, self._next_dummy + len(dummy_tokens)))
            self._next_dummy += len(dummy_tokens)
            dummies = self._dummies(self.draft_manager, ids, dummy_tokens)
        try:
            self._prepare(batch, dummies)
            result = self._forward(batch, chunks, optimistic)
            self._update(batch)
        finally:
            for dummy in dummies:
                self.draft_manager.free_resources(dummy)
                if self.speculator is not None:
                    self.speculator.release(dummy.py_request_id)
        for req in batch.all_requests():
            if req.num_generated >= req.max_new_tokens:
                self.complete(req)
        self.stats.steps += 1
        if self.on_step is not None:
            self.on_step(self)
        return result

    # -- phases -------------------------------------------------------------------
    def _schedule(self) -> ScheduledRequests:
        batch = self.scheduler.schedule()
        if batch.batch_size == 0:
            raise RuntimeError(
                f"the scheduler made no progress: {len(self.scheduler.active)} active requests, "
                f"{len(self.scheduler.waiting)} waiting; is the step budget smaller than a chunk?"
            )
        return batch

    def _prepare(self, batch: ScheduledRequests, dummies: list[LlmRequest]) -> None:
        """Size every cache (dummies: draft side only) and map the drafter's rows to slots."""
        sized = batch
        if dummies:
            sized = ScheduledRequests(list(batch.context_requests), [*batch.generation_requests, *dummies])
        self.verifier.prepare(batch)
        if self.draft_manager is not None:
            with request_context(True, sized):
                self.draft_manager.prepare_resources(sized)
        self._sample_occupancy()  # the peak is right after sizing, before history advances
        if self.speculator is not None:
            self.speculator.prepare(sized)

    def _forward(
        self, batch: ScheduledRequests, chunks: Mapping[int, int] | None, optimistic: Collection[int] | None
    ) -> StepResult:
        for req in batch.context_requests:
            self._context_chunk(req, chunks)
        accepted: dict[int, int] = {}
        drafted: dict[int, int] = {}
        for req in batch.generation_requests:
            accepted[req.py_request_id], drafted[req.py_request_id] = self._generation_step(req, optimistic)
        drafts: dict[int, list[int]] = {}
        if self.speculator is not None:
            # Drafts come from the tables decoded at prepare time, before history
            # advances and the windows release pages.
            drafting = [r for r in batch.all_requests() if r.state == LlmRequestState.GENERATION_IN_PROGRESS]
            proposals = self.speculator.propose(drafting, self.tokens)
            for req in drafting:
                req.py_draft_tokens = drafts[req.py_request_id] = proposals.get(req.py_request_id, [])
        return StepResult(accepted, drafted, drafts)

    def _update(self, batch: ScheduledRequests) -> None:
        self.verifier.update(batch)
        if self.draft_manager is not None:
            with request_context(True, batch):
                self.draft_manager.update_context_resources(batch)
                self.draft_manager.update_resources(batch)

    def _context_chunk(self, req: LlmRequest, chunks: Mapping[int, int] | None) -> None:
        """The chunk `[position, position + chunk_size)`; the prompt's last one yields the first output token."""
        rid = req.py_request_id
        tokens = self.tokens[rid]
        view = req.target_view
        start, end = view.position, view.position + view.chunk_size
        if start == req.prepopulated_prompt_len:  # its first chunk: the prefix hit (0 without one) is known now
            self.stats.reused_tokens[rid] = req.prepopulated_prompt_len
        first = self.verifier.context(req, tokens, start, end)
        if first is not None:
            tokens[req.prompt_len] = first
            req.tokens.append(first)
        if self.speculator is not None:
            self.speculator.store_context(req, tokens, start, end)
        req.advance_context_chunk(self.scheduler.config.chunk_size if chunks is None else chunks.get(rid))
        if first is not None:
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            self.stats.generated_tokens += 1

    def _generation_step(self, req: LlmRequest, optimistic: Collection[int] | None) -> tuple[int, int]:
        """Verify the drafts at positions n .. n + k - 1 (n: tokens held); returns (accepted, verified drafts)."""
        rid = req.py_request_id
        tokens = self.tokens[rid]
        n = req.max_beam_num_tokens
        drafts = req.py_draft_tokens[: self.scheduler.config.max_draft_len]
        if drafts:
            tokens[n : n + len(drafts)] = torch.tensor(drafts, device=tokens.device)
        verdict = self.verifier.verify(req, tokens, drafts)
        # The accepted drafts equal the predictions before them; the next prediction is the bonus.
        new = verdict.preds[: verdict.accepted + 1][: req.max_new_tokens - req.num_generated]
        if self.speculator is not None and new:
            trial = len(new) < len(verdict.preds) if optimistic is None else rid in optimistic
            self.speculator.store_verified(req, tokens, verdict.preds, len(new), optimistic=trial)
        tokens[n : n + len(new)] = torch.tensor(new, device=tokens.device)
        req.tokens.extend(new)
        req.py_num_accepted_draft_tokens = verdict.accepted
        self.stats.generation_steps += 1
        self.stats.accepted_tokens += len(new)
        self.stats.generated_tokens += len(new)
        return verdict.accepted, len(verdict.drafts)

    def complete(self, req: LlmRequest) -> None:
        """A finished request: its output recorded, every page and its drafter slot freed."""
        rid = req.py_request_id
        req.state = LlmRequestState.GENERATION_COMPLETE
        self.stats.outputs[rid] = req.tokens[req.prompt_len :]
        if self.on_complete is not None:
            self.on_complete(req, self)  # before any page is freed: a context worker sends them
        self.verifier.release(req)
        if self.draft_manager is not None and self.draft_manager.has_cache(rid):  # a request never scheduled has none
            self.draft_manager.free_resources(req)
        if self.speculator is not None:
            self.speculator.release(rid)
        self.scheduler.retire(req)
        del self.tokens[rid]
        self.stats.finished += 1

    def check_pools_idle(self) -> int:
        """Every request finished: every page of every pool (target and draft) must be free or cached-free.

        Sets `stats.pages_held_at_end` (distinct pages still held, 0 when clean) and
        `stats.cached_free_pages_at_end` (published pages kept for later hits); a page still held
        also becomes the run's first error, naming the pool and the counts. Returns the pages held.
        """
        held = cached = 0
        for manager in (self.target_manager, self.draft_manager):
            if manager is None:
                continue
            for g, pool in enumerate(manager.pools()):
                pool.check_accounting()
                if pool.num_held:
                    self.stats.first_error = self.stats.first_error or (
                        f"{manager.error_label} pool {g}: {pool.num_held} of {pool.total} pages still held after "
                        f"every request finished ({pool.num_cached_free} cached-free, {pool.num_plain_free} free)"
                    )
                held += pool.num_held
                cached += pool.num_cached_free
        self.stats.pages_held_at_end = held
        self.stats.cached_free_pages_at_end = cached
        return held

    def _sample_occupancy(self) -> None:
        if self.draft_manager is None:
            return
        held = [self.draft_manager.get_cache(rid).num_held_pages() for rid in self.draft_manager.request_ids()]
        self.stats.draft_pool_occupancy.append(sum(held))
        self.stats.draft_requests_per_step.append(len(held))
        if held:
            self.stats.peak_draft_pages_per_request = max(self.stats.peak_draft_pages_per_request, max(held))
