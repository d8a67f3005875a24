"""A PyExecutor-style loop: schedule, size, forward, verify, update, complete.

Per step, in order: the scheduler picks context chunks and generation
requests; the target manager and (under `request_context(is_draft=True)`) the
draft manager size every cache; the drafter maps rows to slots; context
chunks write target K/V and drafter context; generation rows verify the
previous step's drafts greedily against the target; the managers advance
history (`update_context_resources`, `update_resources`); finished requests
free every page. A resize failure ends the run, as it kills a real executor,
and is recorded with its message.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..manager import KVCacheManagerV2, KVCacheResizeError
from ..manager.admission import AdmissionRefused
from ..manager.mirror_sizing import MirrorSizing
from ..request import LlmRequest, LlmRequestState, ScheduledRequests, request_context
from .scheduler import Scheduler
from .target_model import TinyTarget


class Speculator(Protocol):
    """What the loop needs from a drafter (see executor/drafting.py)."""

    foreign_page_accesses: int

    def prepare(self, batch: ScheduledRequests) -> None: ...

    def store_context(self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int) -> None: ...

    def store_accepted(
        self, req: LlmRequest, tokens: torch.Tensor, start: int, end: int, verified_end: int | None = None
    ) -> None: ...

    def propose(self, reqs: list[LlmRequest], tokens: dict[int, torch.Tensor]) -> dict[int, list[int]]: ...

    def release(self, request_id: int) -> None: ...


@dataclass
class RunStats:
    finished: int = 0
    resize_failures: int = 0
    refused_requests: int = 0  # refused at admission (the pool's charge does not cover them)
    first_error: str = ""
    foreign_page_accesses: int = 0
    stale_reads: int = 0
    unbacked_accesses: int = 0
    accounting_errors: int = 0
    slot_reseeds: int = 0
    max_seed_lag_tokens: int = 0
    peak_draft_pages_per_request: int = 0
    skipped_warmups: int = 0
    generation_steps: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    wall_s: float = 0.0
    draft_pool_occupancy: list[int] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a generation step adds per request (accepted drafts + the bonus)."""
        return self.accepted_tokens / self.generation_steps if self.generation_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


#: What the drafter's ownership checker and slot bookkeeping report into RunStats.
_SPECULATOR_COUNTERS = (
    "foreign_page_accesses",
    "stale_reads",
    "unbacked_accesses",
    "accounting_errors",
    "slot_reseeds",
    "max_seed_lag_tokens",
)


class Executor:
    """Drives requests through a target manager, an optional draft manager and drafter."""

    def __init__(
        self,
        *,
        target_manager: KVCacheManagerV2,
        target_model: TinyTarget,
        scheduler: Scheduler,
        max_new_tokens: int,
        draft_manager: KVCacheManagerV2 | None = None,
        speculator: Speculator | None = None,
        on_step: Callable[["Executor"], None] | None = None,
        on_complete: Callable[[LlmRequest, "Executor"], None] | None = None,
    ) -> None:
        self.target_manager = target_manager
        self.target_model = target_model
        self.scheduler = scheduler
        self.max_new_tokens = max_new_tokens
        self.draft_manager = draft_manager
        self.speculator = speculator
        self.on_step = on_step
        self.on_complete = on_complete
        self.tokens: dict[int, torch.Tensor] = {}
        self.stats = RunStats()
        self._started: float | None = None
        self._device = target_manager.config.device

    # -- requests ---------------------------------------------------------------
    def _buffer(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids on the device with room for every generated and draft token."""
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

    def refuse(self, err: AdmissionRefused) -> None:
        self.stats.refused_requests += 1
        self.stats.first_error = self.stats.first_error or str(err).splitlines()[0]

    def add_generation_request(self, req: LlmRequest, tokens: torch.Tensor) -> None:
        """A request whose prompt was computed elsewhere (disaggregated generation worker)."""
        self.tokens[req.py_request_id] = self._buffer(tokens)
        self.scheduler.active.append(req)

    # -- warmup -------------------------------------------------------------------
    def warmup(self, num_dummies: int, token_num: int) -> bool:
        """CUDA-graph-style warmup: generation dummies of `token_num` tokens in both pools, then freed.

        The dummies carry `history_hint = token_num - 1`, so a windowed pool backs
        only their window. A warmup the draft pool cannot hold is skipped and
        counted, as an executor would skip that graph; returns whether it ran.
        """
        ids = [-(i + 1) for i in range(num_dummies)]
        history = token_num - 1
        draft_len = self.scheduler.config.max_draft_len
        made: list[tuple[KVCacheManagerV2, LlmRequest]] = []
        try:
            for manager in (self.target_manager, self.draft_manager):
                if manager is None:
                    continue
                dummies = manager.add_dummy_requests(
                    ids, [token_num] * num_dummies, is_gen=True, max_num_draft_tokens=draft_len, history_hint=history
                )
                made.extend((manager, d) for d in dummies)
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
        if self.speculator is not None:
            for name in _SPECULATOR_COUNTERS:
                setattr(self.stats, name, getattr(self.speculator, name, 0))
        return self.stats

    def step(self) -> None:
        batch = self.scheduler.schedule()
        if batch.batch_size == 0:
            raise RuntimeError(
                f"the scheduler made no progress: {len(self.scheduler.active)} active requests, "
                f"{len(self.scheduler.waiting)} waiting; is the step budget smaller than a chunk?"
            )
        self.target_manager.prepare_resources(batch)
        if self.draft_manager is not None:
            with request_context(True, batch):
                self.draft_manager.prepare_resources(batch)
        self._sample_occupancy()  # the peak is right after sizing, before history advances
        if self.speculator is not None:
            self.speculator.prepare(batch)

        for req in batch.context_requests:
            self._context_chunk(req)
        for req in batch.generation_requests:
            self._generation_step(req)

        if self.speculator is not None:
            # Drafts come from the tables decoded at prepare time, before history
            # advances and the windows release pages.
            drafting = [r for r in batch.all_requests() if r.state == LlmRequestState.GENERATION_IN_PROGRESS]
            proposals = self.speculator.propose(drafting, self.tokens)
            for req in drafting:
                req.py_draft_tokens = proposals.get(req.py_request_id, [])

        self.target_manager.update_context_resources(batch)
        self.target_manager.update_resources(batch)
        if self.draft_manager is not None:
            with request_context(True, batch):
                self.draft_manager.update_context_resources(batch)
                self.draft_manager.update_resources(batch)
        for req in batch.all_requests():
            if req.num_generated >= req.max_new_tokens:
                self._complete(req)
        self.stats.steps += 1
        if self.on_step is not None:
            self.on_step(self)

    # -- phases -------------------------------------------------------------------
    def _context_chunk(self, req: LlmRequest) -> None:
        rid = req.py_request_id
        tokens = self.tokens[rid]
        view = req.target_view
        start, end = view.position, view.position + view.chunk_size
        self.target_model.write_kv(rid, tokens, start, end)
        if end >= req.prompt_len:
            first = self.target_model.predict(rid, tokens, [req.prompt_len - 1])[0]
            tokens[req.prompt_len] = first
            req.tokens.append(first)
        if self.speculator is not None:
            self.speculator.store_context(req, tokens, start, end)
        req.advance_context_chunk(self.scheduler.config.chunk_size)
        if end >= req.prompt_len:
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            self.stats.generated_tokens += 1

    def _generation_step(self, req: LlmRequest) -> None:
        rid = req.py_request_id
        tokens = self.tokens[rid]
        n = req.max_beam_num_tokens
        drafts = req.py_draft_tokens[: self.scheduler.config.max_draft_len]
        if drafts:
            tokens[n : n + len(drafts)] = torch.tensor(drafts, device=tokens.device)
        self.target_model.write_kv(rid, tokens, n - 1, n + len(drafts))
        preds = self.target_model.predict(rid, tokens, list(range(n - 1, n + len(drafts))))
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == preds[accepted]:
            accepted += 1
        new = drafts[:accepted] + [preds[accepted]]
        new = new[: req.max_new_tokens - req.num_generated]
        tokens[n : n + len(new)] = torch.tensor(new, device=tokens.device)
        req.tokens.extend(new)
        req.py_num_accepted_draft_tokens = accepted
        self.stats.generation_steps += 1
        self.stats.accepted_tokens += len(new)
        self.stats.generated_tokens += len(new)
        if self.speculator is not None and len(new) > 0:
            # Positions n-1 .. n-2+len(new) now hold verified tokens with known successors.
            self.speculator.store_accepted(req, tokens, n - 1, n - 1 + len(new), verified_end=n + len(drafts))

    def _complete(self, req: LlmRequest) -> None:
        rid = req.py_request_id
        req.state = LlmRequestState.GENERATION_COMPLETE
        self.stats.outputs[rid] = req.tokens[req.prompt_len :]
        if self.on_complete is not None:
            self.on_complete(req, self)  # before any page is freed: a context worker sends them
        self.target_manager.free_resources(req)
        if self.draft_manager is not None:
            self.draft_manager.free_resources(req)
        if self.speculator is not None:
            self.speculator.release(rid)
        self.scheduler.retire(req)
        del self.tokens[rid]
        self.stats.finished += 1

    def _sample_occupancy(self) -> None:
        if self.draft_manager is None:
            return
        held = [self.draft_manager.get_cache(rid).num_held_pages() for rid in self.draft_manager.request_ids()]
        self.stats.draft_pool_occupancy.append(sum(held))
        if held:
            self.stats.peak_draft_pages_per_request = max(self.stats.peak_draft_pages_per_request, max(held))
