"""DraftLoop: a minimal single-worker executor loop driving the DFlash drafter in call order.

It stands in for the executor of a one-engine external drafter with its own
draft pool, and does exactly what ``dflash_metadata``'s docstring lists, with a
*target oracle* in place of the target model: each request carries its ground-
truth token stream, the target's greedy next token is the next truth token, and
hidden states come from :class:`TokenFeatures`. Only the draft side exists (no
target cache); the draft manager, the metadata, the drafter and the pool
tensors are the real ones.

Per :meth:`step`:

0. warmup dummies (``draft_manager.add_dummy_requests``) join as generation rows;
   ``draft_manager.prepare_resources(batch)``;
1. ``meta.prepare(batch, draft_manager)`` (on a pool paired with the target's block
   reuse the loop then writes the reused prefix's drafter K/V a context tail reads,
   standing in for the earlier request that shared the prefix);
2. context rows: ``drafter.store_context(req, positions, hidden)``;
3. generation rows: verify the drafts against the truth (acceptance optionally
   capped); optionally commit every verified token first and ``rollback()``
   (a rejected optimistic commit); ``drafter.commit_step({rid: hidden})``;
4. append the accepted tokens and the bonus token, advance context views;
5. ``drafter.propose()`` -> each request's next drafts;
6. ``draft_manager.update_context_resources`` / ``update_resources``; dummies freed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping

import torch

from ..config import KvCacheConfig, LayerGroupConfig, SpeculativeDecodingMode
from ..request import ContextView, LlmRequest, LlmRequestState, ScheduledRequests
from ..speculative.dflash_metadata import DFlashSpecMetadata, required_extra_kv_tokens
from .drafter import DFlashDrafter, DFlashDrafterConfig
from .features import TokenFeatures, acceptance
from .ownership import OwnershipChecker


@dataclasses.dataclass
class StepResult:
    accepted: dict[int, int]  # generation request id -> accepted drafts this step
    drafted: dict[int, int]  # generation request id -> drafts verified this step
    drafts: dict[int, list[int]]  # request id -> drafts proposed for the next step


class DraftLoop:
    """A draft manager, a DFlashSpecMetadata and a DFlashDrafter driven by a truth oracle."""

    def __init__(
        self,
        draft_manager,
        meta: DFlashSpecMetadata,
        drafter: DFlashDrafter,
        features: TokenFeatures,
    ) -> None:
        self.dm = draft_manager
        self.meta = meta
        self.drafter = drafter
        self.features = features
        self.requests: dict[int, LlmRequest] = {}
        self.truth: dict[int, list[int]] = {}
        self.accepted_total = 0
        self.drafted_total = 0
        self.generation_steps = 0
        self._next_dummy = 1 << 40

    @classmethod
    def build(
        cls,
        *,
        windows: tuple = (None,),
        layers_per_group: tuple | None = None,
        pages: int | tuple = 256,
        tokens_per_block: int = 16,
        block_size: int = 4,
        vocab_size: int = 64,
        feature_dim: int = 6,
        num_kv_heads: int = 1,
        head_dim: int = 8,
        max_seq_len: int = 4096,
        max_batch_size: int = 8,
        spec_mode: SpeculativeDecodingMode = SpeculativeDecodingMode.DFLASH,
        joint_kv_cache_reuse: bool = False,
        trail_page: bool = True,
        guard_page: bool = False,
        seeding: str = "base",
        fused: bool = False,
        backend: str = "cpp",
        page_aligned_seed: bool | None = None,
        checker: bool = True,
        raise_on_violation: bool = False,
        device: str = "cpu",
        feature_seed: int = 0,
        private_arena: bool = False,
        max_ctx_len: int | None = None,
    ) -> "DraftLoop":
        """A draft manager (one layer group per window), metadata, drafter, features and checker.

        The drafter has ``block_size - 1`` layers, spread over the groups as
        ``layers_per_group`` says (default: all in the first group, one in each
        other). The manager leaves room for the block
        (``num_extra_kv_tokens = required_extra_kv_tokens(block_size)``).
        """
        from ..manager import DraftKVCacheManagerV2

        num_layers = block_size - 1
        if layers_per_group is None:
            rest = len(windows) - 1
            layers_per_group = (num_layers - rest, *([1] * rest))
        if sum(layers_per_group) != num_layers or len(layers_per_group) != len(windows):
            raise ValueError(
                f"layers_per_group {layers_per_group} must cover {num_layers} layers in {len(windows)} groups"
            )
        pages = (pages,) * len(windows) if isinstance(pages, int) else tuple(pages)
        config = KvCacheConfig(
            layer_groups=tuple(LayerGroupConfig(n, window=w) for n, w in zip(layers_per_group, windows)),
            pages_per_group=pages,
            tokens_per_block=tokens_per_block,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            device=device,
            guard_page=guard_page,
            max_seq_len=max_seq_len,
        )
        dm = DraftKVCacheManagerV2(
            config,
            spec_mode=spec_mode,
            max_draft_len=block_size - 1,
            num_extra_kv_tokens=required_extra_kv_tokens(block_size),
            joint_kv_cache_reuse=joint_kv_cache_reuse,
            trail_page=trail_page,
        )
        meta = DFlashSpecMetadata(
            max_batch_size,
            block_size=block_size,
            tokens_per_block=tokens_per_block,
            max_ctx_len=max_seq_len if max_ctx_len is None else max_ctx_len,
            device=device,
            seeding=seeding,
            fused=fused,
            backend=backend,
            page_aligned_seed=page_aligned_seed,
        )
        features = TokenFeatures(vocab_size, feature_dim, num_layers, seed=feature_seed, device=device)
        chk = OwnershipChecker(dm, raise_on_violation=raise_on_violation) if checker else None
        drafter = DFlashDrafter(
            DFlashDrafterConfig(
                vocab_size, block_size, feature_dim=feature_dim, num_kv_heads=num_kv_heads, head_dim=head_dim
            ),
            features,
            meta,
            None if private_arena else dm,
            checker=chk,
        )
        return cls(dm, meta, drafter, features)

    @property
    def checker(self) -> OwnershipChecker | None:
        return self.drafter.checker

    @property
    def block_size(self) -> int:
        return self.meta.block_size

    # ------------------------------------------------------------------ requests
    def add_context_request(
        self, rid: int, truth: list[int], prompt_len: int, *, chunk: int | None = None, start: int = 0
    ) -> LlmRequest:
        """A prefill request; ``start > 0``: a prefix this worker did not compute (e.g. a reuse hit)."""
        if not 0 <= start < prompt_len < len(truth):
            raise ValueError(f"need 0 <= start < prompt_len < len(truth), got {start}, {prompt_len}, {len(truth)}")
        req = LlmRequest(rid, prompt_len, tokens=list(truth[:prompt_len]))
        size = prompt_len - start if chunk is None else min(chunk, prompt_len - start)
        req.target_view = ContextView(start, size)
        self.requests[rid] = req
        self.truth[rid] = truth
        return req

    def add_disagg_request(self, rid: int, truth: list[int], prompt_len: int) -> LlmRequest:
        """A generation worker's new request: prompt + first token arrive, the mirror is gen-init sized."""
        req = LlmRequest(
            rid, prompt_len, tokens=list(truth[: prompt_len + 1]), state=LlmRequestState.DISAGG_GENERATION_INIT
        )
        self.dm.prepare_disagg_gen_init(req)
        req.state = LlmRequestState.GENERATION_IN_PROGRESS
        self.requests[rid] = req
        self.truth[rid] = truth
        return req

    def finish(self, rid: int) -> None:
        req = self.requests.pop(rid)
        self.truth.pop(rid)
        req.state = LlmRequestState.GENERATION_COMPLETE
        self.meta.free(rid, missing_ok=True)
        if self.dm.has_cache(rid):  # a request never scheduled holds no mirror
            self.dm.free_resources(rid)
        if self.drafter.checker is not None:
            self.drafter.checker.forget(rid)

    def evict(self, rid: int) -> None:
        self.meta.evict(rid)

    def remaining(self, rid: int) -> int:
        """Truth tokens left after the request's tokens (a step may append up to block_size)."""
        return len(self.truth[rid]) - len(self.requests[rid].tokens)

    # ------------------------------------------------------------------ one step
    def _tokens(self, rid: int, upto: int) -> torch.Tensor:
        return torch.tensor(self.truth[rid][:upto], dtype=torch.long)

    def _hidden(self, rid: int, tokens: list[int], positions: range, next_tokens: list[int]) -> torch.Tensor:
        return self.features.hidden_states(
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(list(positions), dtype=torch.long),
            torch.tensor(next_tokens, dtype=torch.long),
        )

    def _simulate_block_reuse(self, ctx_reqs: list[LlmRequest]) -> None:
        """On a pool paired with the target's block reuse a context tail is stored at its target
        position over base 0 and reads the prefix's drafter K/V from the pool. Here nobody
        computed that prefix, so the loop puts it there (what an earlier request sharing the
        prefix would have left), on the pages the mirror backs."""
        if not getattr(self.dm, "joint_kv_cache_reuse", False) or self.drafter.draft_manager is None:
            return
        for req in ctx_reqs:
            seed = self.meta.seeds.get(req.py_request_id)
            if seed is None or seed.base_pages != 0 or seed.ctx_len == 0:
                continue
            truth = self.truth[req.py_request_id]
            pos = range(0, seed.ctx_len)
            hidden = self._hidden(req.py_request_id, truth[: seed.ctx_len + 1], pos, [truth[p + 1] for p in pos])
            self.drafter.write_reused_prefix(req, torch.tensor(list(pos)), hidden)

    def step(
        self,
        rids: Iterable[int] | None = None,
        *,
        chunks: Mapping[int, int] | None = None,
        accept_cap: Mapping[int, int] | Callable[[int], int] | None = None,
        optimistic: Iterable[int] = (),
        dummies: int = 0,
        dummy_tokens: int | Iterable[int] = 1,
    ) -> StepResult:
        """One executor step over ``rids`` (default: every live request).

        ``chunks``: next chunk size of context requests after this one (default:
        the rest of the prompt). ``accept_cap``: most drafts a generation request
        may accept this step (forced rejections). ``optimistic``: generation
        requests whose every verified token is committed first, then rolled back
        to what was accepted. ``dummies``: warmup dummies of ``dummy_tokens`` (one
        count for all, or one per dummy).
        """
        ids = list(self.requests) if rids is None else list(rids)
        ctx_reqs = [self.requests[r] for r in ids if self.requests[r].is_context_init_state]
        gen_reqs = [self.requests[r] for r in ids if self.requests[r].is_generation_in_progress_state]
        dummy_reqs: list[LlmRequest] = []
        if dummies:
            dummy_ids = list(range(self._next_dummy, self._next_dummy + dummies))
            self._next_dummy += dummies
            sizes = [dummy_tokens] * dummies if isinstance(dummy_tokens, int) else list(dummy_tokens)
            dummy_reqs = self.dm.add_dummy_requests(
                dummy_ids,
                sizes,
                is_gen=True,
                max_num_draft_tokens=self.dm.max_draft_len,
                history_hint=max(sizes) - 1,
            )
        batch = ScheduledRequests(context_requests=ctx_reqs, generation_requests=[*gen_reqs, *dummy_reqs])
        try:
            self.dm.prepare_resources(batch)
            self.meta.prepare(batch, None if self.drafter.draft_manager is None else self.dm)
            self._simulate_block_reuse(ctx_reqs)

            # (b) context chunks at their target positions
            for req in ctx_reqs:
                rid, view = req.py_request_id, req.target_view
                truth = self.truth[rid]
                pos = range(view.position, view.position + view.chunk_size)
                hidden = self._hidden(rid, truth[: req.prompt_len + 1], pos, [truth[p + 1] for p in pos])
                self.drafter.store_context(req, torch.tensor(list(pos)), hidden)

            # (c) generation rows: verification against the truth, then the commit
            accepted: dict[int, int] = {}
            drafted: dict[int, int] = {}
            commit: dict[int, torch.Tensor] = {}
            trial: dict[int, torch.Tensor] = {}
            optimistic = set(optimistic)
            for req in gen_reqs:
                rid, truth = req.py_request_id, self.truth[req.py_request_id]
                n = len(req.tokens)
                drafts = list(req.py_draft_tokens)[: max(len(truth) - n, 0)]
                a = acceptance(drafts, truth[n : n + len(drafts)])
                if accept_cap is not None:
                    cap = accept_cap(rid) if callable(accept_cap) else accept_cap.get(rid, a)
                    a = min(a, max(int(cap), 0))
                accepted[rid], drafted[rid] = a, len(drafts)
                pos = range(n - 1, n + a)
                commit[rid] = self._hidden(rid, truth[: n + a + 1], pos, [truth[p + 1] for p in pos])
                if rid in optimistic:
                    seq = list(req.tokens) + drafts
                    vpos = range(n - 1, n + len(drafts))
                    trial[rid] = self._hidden(rid, seq, vpos, [truth[p + 1] for p in vpos])
            if trial:
                snap = self.meta.snapshot()
                self.drafter.commit_step(trial)
                self.meta.rollback(snap)
            if commit:
                self.drafter.commit_step(commit)

            # advance the requests
            for req in gen_reqs:
                rid, n = req.py_request_id, len(req.tokens)
                req.tokens.extend(self.truth[rid][n : n + accepted[rid] + 1])
                req.py_num_accepted_draft_tokens = accepted[rid]
            for req in ctx_reqs:
                nxt = None if chunks is None else chunks.get(req.py_request_id)
                req.advance_context_chunk(nxt)
                if req.target_view.position >= req.prompt_len:
                    req.state = LlmRequestState.GENERATION_IN_PROGRESS
                    req.tokens.append(self.truth[req.py_request_id][req.prompt_len])

            # (d) drafts for the next step
            drafts_t = self.drafter.propose()
            drafts_out: dict[int, list[int]] = {}
            for i, row in enumerate(self.meta.rows):
                if row.proposing and not row.request.is_dummy:
                    d = drafts_t[i].tolist()
                    row.request.py_draft_tokens = d
                    drafts_out[row.request_id] = d
                elif not row.request.is_dummy:
                    row.request.py_draft_tokens = []

            real = ScheduledRequests(context_requests=ctx_reqs, generation_requests=gen_reqs)
            self.dm.update_context_resources(ScheduledRequests(context_requests=ctx_reqs))
            self.dm.update_resources(real)
        finally:
            for d in dummy_reqs:
                self.dm.free_resources(d)
                if self.drafter.checker is not None:
                    self.drafter.checker.forget(d.py_request_id)
        if gen_reqs:
            self.generation_steps += 1
        self.accepted_total += sum(accepted.values())
        self.drafted_total += sum(drafted.values())
        return StepResult(accepted, drafted, drafts_out)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_total / max(self.drafted_total, 1)
