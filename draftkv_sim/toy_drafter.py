"""The toy drafter model: a tiny DFlash-style drafter in torch that stores and reads its K/V through the draft pool.

The executor does not call it directly: speculator.py's `DFlashSpeculator` drives it step by step.

Shape of the model. ``block_size - 1`` attention layers, one per draft offset,
with hand-set weights (no training) over the hidden states of
:class:`~draftkv_sim.features.TokenFeatures`:

* layer ``l``'s K of a context position ``s`` is feature section ``l`` (the
  token ``l`` places before ``s``) in the first ``feature_dim`` channels of
  every head, plus a constant pair rotated by RoPE at ``s`` (a low frequency, on
  its own two channels); its V is the last section, the target's next token
  after ``s``;
* the block decode puts ``block_size`` queries at ``query_pos = L + j`` (the
  bonus token and ``block_size - 1`` mask tokens); each query carries
  ``content_scale * E[bonus]`` and the rotated constant pair. The block's own
  K/V (RoPE only, zero value) is appended to the pool at the query positions,
  and every query attends non-causally over the (windowed) context and the
  whole block, read back through the block table;
* draft ``j`` (``1 <= j < block_size``) is ``argmax_v E[v] · out_l[j]`` with
  ``l = j - 1``. Query ``j`` so finds the context position ``s`` whose token
  ``j - 1`` places back equals the bonus token and returns the token after
  ``s``: on text made of repeated phrases it continues the phrase, and reading
  the wrong context (foreign pages, wrong positions) makes it draft garbage.

Addressing (all through :class:`DFlashDraftSlots`): context K/V is stored at
slot positions on ``row[s // P]`` of the request's unrebased row; the block is
appended onto ``row[q // P]``; context reads go through the row rebased past the
slot's base, ``[max(0, read_len + block_size - W), read_len)`` in rebased
coordinates for a window ``W`` (the block and its context span the last ``W``
positions up to the block's end), the whole ``[0, read_len)`` without one.

The same code runs on CPU and CUDA; the pools decide the device. With a
:class:`~draftkv_sim.ownership.OwnershipChecker` attached
every write and every read within the attended span is reported to it.
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Callable, Mapping, Sequence

import torch

from tensorrt_llm_draftkv.llmapi import DFlashDecodingConfig
from tensorrt_llm_draftkv.mapping import Mapping as ParallelMapping
from tensorrt_llm_draftkv.request import LlmRequest
from tensorrt_llm_draftkv.speculative.dflash_worker import DFlashWorker
from tensorrt_llm_draftkv.speculative.draft_slots import DFlashDraftSlots
from .features import TokenFeatures
from .ownership import OwnershipChecker


@dataclasses.dataclass(frozen=True)
class DFlashDrafterConfig:
    """Geometry and hand-set weights of the toy drafter.

    ``windows``: the attention window of each layer (None = full attention);
    left None, each layer takes the window of the draft pool's layer group it
    lives in (the model config the pool was built from).
    """

    vocab_size: int
    block_size: int = 4
    feature_dim: int = 6
    num_kv_heads: int = 1
    head_dim: int = 8
    windows: tuple | None = None
    content_scale: float = 64.0
    rope_weight: float = 4.0
    rope_freq: float = 1.0 / 256
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.head_dim < self.feature_dim + 2:
            raise ValueError(
                f"head_dim {self.head_dim} must hold feature_dim {self.feature_dim} plus 2 rotary channels"
            )
        if self.windows is not None and len(self.windows) != self.num_layers:
            raise ValueError(f"{len(self.windows)} windows for {self.num_layers} layers")

    @property
    def num_layers(self) -> int:
        return self.block_size - 1


def _storage_rows(storage: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``storage`` (``[pages, 2, H, P, D]``, viewed as ``[-1, D]``) holding K and V of every head at
    ``(pages[i], offsets[i])``: ``[*pages.shape, 2, H]``. One flat index instead of two advanced indices
    around slices, which torch turns into a slow scatter."""
    _, two, H, P, _ = storage.shape
    kv_head = torch.arange(two * H, device=pages.device).view(two, H)
    return (pages[..., None, None] * (two * H) + kv_head) * P + offsets[..., None, None]


def bind_worker(config: DFlashDrafterConfig, metadata: DFlashDraftSlots, draft_manager=None) -> DFlashWorker:
    """A DFlash worker over these slots: bound to the draft pool, or to a private arena of its own."""
    worker = DFlashWorker(DFlashDecodingConfig(max_draft_len=config.block_size - 1), ParallelMapping(), True,
                          device=metadata.device)
    shape = SimpleNamespace(_num_attn_layers=config.num_layers, _num_kv_heads=config.num_kv_heads,
                            _head_dim=config.head_dim, _kv_factor=2, dtype=config.dtype)
    worker.bind_draft_slots(metadata, draft_manager, draft_model=shape)
    return worker


class _Group:
    """The drafter layers that live in one pool (layer group): they share pages and positions."""

    def __init__(self, index: int, layers: list[int], storages: list[torch.Tensor]) -> None:
        self.index = index
        self.layers = layers
        self.storages = storages


@dataclasses.dataclass
class _ContextRead:
    """The context one group's rows read this step, ``[R, width]`` each.

    ``rebased``: positions rebased past the slot's base; ``ordinals``: rebased page ordinals;
    ``pages``: pool pages (-1 where not ``valid``); ``positions``: slot positions; ``kv``: the gathered K/V.
    """

    rebased: torch.Tensor
    valid: torch.Tensor
    ordinals: torch.Tensor
    pages: torch.Tensor
    positions: torch.Tensor
    kv: torch.Tensor
    width: int


class DFlashDrafter:
    """Stores target hidden states as draft K/V in the pool and decodes blocks of drafts."""

    def __init__(
        self,
        config: DFlashDrafterConfig,
        features: TokenFeatures,
        metadata: DFlashDraftSlots,
        draft_manager=None,
        *,
        checker: OwnershipChecker | None = None,
        worker: DFlashWorker | None = None,
    ) -> None:
        self._check_inputs(config, features, metadata)
        self.config = config
        self.features = features
        self.meta = metadata
        self.draft_manager = draft_manager
        self.checker = checker
        if checker is not None:
            checker.attach(metadata)
        self._groups: list[_Group] = []
        if draft_manager is not None:
            self._check_pool(config, draft_manager.config, metadata.tokens_per_block)
            #: every write into the drafter's storage goes through the worker, as in an executor
            self.worker = worker if worker is not None else bind_worker(config, metadata, draft_manager)
            windows = self._groups_from_pool(draft_manager)
            self.device = self._groups[0].storages[0].device
        else:
            self.worker = worker if worker is not None else bind_worker(config, metadata, draft_manager)
            self.device = metadata.device
            self._groups.append(_Group(0, list(range(config.num_layers)), list(self.worker._ctx_kv_buf)))
            windows = [None] * config.num_layers
        self.windows: tuple = tuple(config.windows) if config.windows is not None else tuple(windows)
        self.E = features.E.to(device=self.device, dtype=config.dtype)
        self._build_weights()
        #: test hook: ``fn(group, read_rows) -> read_rows`` applied before context reads
        self.debug_read_rows_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None

    @staticmethod
    def _check_inputs(config: DFlashDrafterConfig, features: TokenFeatures, metadata: DFlashDraftSlots) -> None:
        """Refuse features or slots whose geometry does not fit the drafter config."""
        if features.dim != config.feature_dim:
            raise ValueError(f"features have {features.dim}-dim sections, the drafter expects {config.feature_dim}")
        if features.history < config.num_layers:
            raise ValueError(
                f"hidden states keep {features.history} tokens of history; {config.num_layers} layers need "
                f"{config.num_layers}"
            )
        if features.vocab_size != config.vocab_size:
            raise ValueError(f"features cover {features.vocab_size} tokens, the drafter {config.vocab_size}")
        if metadata.block_size != config.block_size:
            raise ValueError(f"metadata block_size {metadata.block_size} != drafter block_size {config.block_size}")

    @staticmethod
    def _check_pool(config: DFlashDrafterConfig, cfg, tokens_per_block: int) -> None:
        """Refuse a draft pool (its manager config ``cfg``) whose pages, heads or layers do not fit the drafter."""
        P = tokens_per_block
        if cfg.tokens_per_block != P:
            raise ValueError(f"draft pool pages hold {cfg.tokens_per_block} tokens, metadata {P}")
        if cfg.kv_factor != 2 or cfg.num_kv_heads != config.num_kv_heads or cfg.head_dim != config.head_dim:
            raise ValueError(
                f"draft pool geometry (kv_factor={cfg.kv_factor}, heads={cfg.num_kv_heads}, "
                f"head_dim={cfg.head_dim}) does not fit the drafter (2, {config.num_kv_heads}, {config.head_dim})"
            )
        total = sum(g.num_layers for g in cfg.layer_groups)
        if total != config.num_layers:
            raise ValueError(f"the draft pool has {total} layers, the drafter {config.num_layers}")

    def _groups_from_pool(self, draft_manager) -> list:
        """Append one :class:`_Group` per pool layer group (drafter layers numbered in pool order); return each
        layer's window."""
        cfg = draft_manager.config
        windows: list = []
        layer = 0
        for g, group in enumerate(draft_manager.layer_groups):
            n = len(group.pool.layers)
            layers = list(range(layer, layer + n))
            self._groups.append(_Group(g, layers, [self.worker._ctx_kv_buf[i] for i in layers]))
            windows.extend([cfg.layer_groups[g].window] * n)
            layer += n
        return windows

    # ------------------------------------------------------------------ weights
    def _build_weights(self) -> None:
        c, F = self.config, self.features
        H, D, fd = c.num_kv_heads, c.head_dim, c.feature_dim
        dt, dev = c.dtype, self.device
        # per layer: K reads section `layer`, V reads the next-token section
        W = torch.zeros(F.feature_dim, c.num_layers, 2, H, D, dtype=dt, device=dev)
        eye = torch.eye(fd, dtype=dt, device=dev)
        for layer in range(c.num_layers):
            for h in range(H):
                W[F.section(layer), layer, 0, h, :fd] = eye
                W[F.section(F.history), layer, 1, h, :fd] = eye
        self.W_kv = W
        self._W_group = [W[:, g.layers].reshape(F.feature_dim, -1).contiguous() for g in self._groups]
        self.W_q = torch.zeros(fd, H, D, dtype=dt, device=dev)
        for h in range(H):
            self.W_q[:, h, :fd] = c.content_scale * eye
        # the rotary pair: a constant (sqrt(r), 0) rotated by theta_h * position
        self.rot_bias = math.sqrt(c.rope_weight)
        self.theta = torch.tensor([c.rope_freq * (h + 1) for h in range(H)], dtype=torch.float64, device=dev)

    def _rotary(self, positions: torch.Tensor) -> torch.Tensor:
        """``[*positions.shape, H, 2]`` the rotated constant pair at ``positions``."""
        ang = positions.to(device=self.device, dtype=torch.float64)[..., None] * self.theta
        pair = torch.stack([torch.cos(ang), torch.sin(ang)], dim=-1) * self.rot_bias
        return pair.to(self.config.dtype)

    def _project_group(self, gi: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[n, Lg, 2, H, D]`` K/V of ``hidden`` ``[n, F]`` at slot ``positions`` for a group's layers."""
        c = self.config
        fd = c.feature_dim
        hidden = hidden.to(device=self.device, dtype=c.dtype)
        n, Lg = hidden.shape[0], len(self._groups[gi].layers)
        kv = (hidden @ self._W_group[gi]).reshape(n, Lg, 2, c.num_kv_heads, c.head_dim)
        kv[:, :, 0, :, fd : fd + 2] = self._rotary(positions)[:, None]
        return kv

    def _block_kv(self, gi: int, positions: torch.Tensor) -> torch.Tensor:
        """``[n, Lg, 2, H, D]`` K/V of block tokens: RoPE only, zero value."""
        c = self.config
        n, Lg = positions.numel(), len(self._groups[gi].layers)
        kv = torch.zeros(n, Lg, 2, c.num_kv_heads, c.head_dim, dtype=c.dtype, device=self.device)
        kv[:, :, 0, :, c.feature_dim : c.feature_dim + 2] = self._rotary(positions.reshape(-1))[:, None]
        return kv

    # ------------------------------------------------------------------ pool I/O
    def _owned_row(self, row: int, gi: int) -> torch.Tensor | None:
        """For a private arena: the pages the row's slot owns (the checker's truth)."""
        if self.draft_manager is not None:
            return None
        pps = self.meta.arena_pages_per_slot
        slot = self.meta.rows[row].slot
        return torch.arange(slot * pps, (slot + 1) * pps, dtype=torch.int64, device=self.device)

    def _write(
        self, row: int, gi: int, positions: torch.Tensor, ordinals: torch.Tensor, pages: torch.Tensor,
        offsets: torch.Tensor, kv: torch.Tensor,
    ) -> None:
        """Write ``kv[i]`` (``[n, Lg, 2, H, D]``) at ``(pages[i], offsets[i])`` in every layer of a group.

        Entries with ``offsets < 0`` are not stored (past the maximum context).
        A ``-1`` page with a valid offset is an unbacked entry: nothing can be
        written there (a real kernel would scribble somewhere); the checker
        counts it.
        """
        self._write_for(
            self.meta.rows[row].request_id, gi, positions, ordinals, pages, offsets, kv, self._owned_row(row, gi)
        )

    def _write_for(
        self, request_id: int, gi: int, positions: torch.Tensor, ordinals: torch.Tensor, pages: torch.Tensor,
        offsets: torch.Tensor, kv: torch.Tensor, owned_row: torch.Tensor | None,
    ) -> None:
        """:meth:`_write` for a request named by id (it need not be a row of this step)."""
        group = self._groups[gi]
        pages, offsets = pages.long(), offsets.long()
        stored = offsets >= 0
        if not bool(stored.all()):
            positions, ordinals, pages, offsets, kv = (
                positions[stored], ordinals[stored], pages[stored], offsets[stored], kv[stored]
            )
        if positions.numel() == 0:
            return
        if self.checker is not None:
            self.checker.record_write(
                request_id, group.index, group.layers, positions, ordinals, pages, kv, owned_row=owned_row
            )
        backed = pages >= 0
        if not bool(backed.all()):
            pages, offsets, kv = pages[backed], offsets[backed], kv[backed]
        self.worker.store_kv_at_pages(group.layers, pages, offsets, kv)

    def _gather(self, gi: int, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``[..., Lg, 2, H, D]`` K/V at ``(pages, offsets)``; a -1 page (unbacked) reads zeros."""
        backed = pages >= 0
        pg = torch.where(backed, pages, 0)
        storages = self._groups[gi].storages
        rows = _storage_rows(storages[0], pg, offsets).reshape(-1)
        D = storages[0].shape[-1]
        kv = torch.stack([s.view(-1, D).index_select(0, rows) for s in storages], dim=0)
        kv = kv.view(len(storages), *pg.shape, 2, storages[0].shape[2], D).movedim(0, -4)
        return kv * backed[..., None, None, None, None].to(kv.dtype)

    def _report_read(
        self, row: int, gi: int, positions: torch.Tensor, ordinals: torch.Tensor, pages: torch.Tensor,
        kv: torch.Tensor,
    ) -> None:
        assert self.checker is not None
        group = self._groups[gi]
        self.checker.record_read(
            self.meta.rows[row].request_id, group.index, group.layers, positions, ordinals, pages, kv,
            owned_row=self._owned_row(row, gi),
        )

    def write_reused_prefix(self, request: LlmRequest | int, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Put K/V a paired pool would already hold (block reuse) onto the request's backed pages.

        A simulation aid for a pool with ``joint_kv_cache_reuse``: the prefix's
        drafter K/V written by an earlier request with the same prefix. Only
        ordinals the mirror backs are written; the checker learns them as reused.
        """
        rid = request if isinstance(request, int) else request.py_request_id
        dm = self.draft_manager
        if dm is None:
            raise ValueError("write_reused_prefix needs a shared draft pool")
        P = self.meta.tokens_per_block
        positions = torch.as_tensor(positions, dtype=torch.int64, device=self.device).reshape(-1)
        hidden = hidden.to(self.device)
        cache = dm.get_cache(rid)
        for gi, group in enumerate(self._groups):
            row = torch.tensor(cache.block_row(group.index), dtype=torch.int64, device=self.device)
            ordinal = positions // P
            inside = ordinal < row.numel()
            page = torch.where(inside, row[torch.where(inside, ordinal, 0)], -1) if row.numel() else -1 - ordinal * 0
            ok = page >= 0
            kv = self._project_group(gi, hidden[ok], positions[ok])
            self.worker.store_kv_at_pages(group.layers, page[ok], positions[ok] % P, kv)
            if self.checker is not None:
                self.checker.mark_reused(rid, group.index, group.layers, positions[ok], kv)

    # ------------------------------------------------------------------ disaggregated handoff
    def mirror_pages(self, request_id: int, gi: int, lo: int, end: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, pages)`` of absolute positions ``[lo, end)`` on the request's own row of group ``gi``.

        Raises ``ValueError`` naming the request and the numbers when a position's ordinal is not backed.
        """
        dm = self.draft_manager
        if dm is None:
            raise ValueError(f"request {request_id}: {what} needs a shared draft pool")
        P = self.meta.tokens_per_block
        group = self._groups[gi]
        row = dm.get_cache(request_id).block_row(group.index)
        first, last = lo // P, (end - 1) // P
        if end > lo and (last >= len(row) or min(row[first : last + 1]) < 0):
            backed = [i for i, page in enumerate(row) if page >= 0]
            raise ValueError(
                f"request {request_id}: {what} of positions [{lo}, {end}) in layer group {group.index} needs pages "
                f"{first}..{last}, but its draft mirror backs only ordinals "
                f"{(backed[0], backed[-1]) if backed else 'none'}"
            )
        positions = torch.arange(lo, end, dtype=torch.int64, device=self.device)
        table = torch.tensor(row[first : last + 1] if end > lo else [], dtype=torch.int64, device=self.device)
        return positions, table[positions // P - first] if end > lo else positions

    def read_stored(self, request_id: int, gi: int, lo: int, end: int) -> torch.Tensor:
        """``[n, Lg, 2, H, D]``: the K/V this pool holds for absolute positions ``[lo, end)`` of a request.

        What a context worker sends (form a): read straight from the pages of the
        request's own row, whatever slot stored them.
        """
        positions, pages = self.mirror_pages(request_id, gi, lo, end, "reading the stored drafter context")
        return self._gather(gi, pages, positions % self.meta.tokens_per_block).clone()

    def project(self, gi: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[n, Lg, 2, H, D]`` K/V the drafter stores for hidden states ``[n, F]`` at absolute ``positions``."""
        positions = torch.as_tensor(positions, dtype=torch.int64, device=self.device).reshape(-1)
        return self._project_group(gi, hidden, positions)

    def write_received(self, request_id: int, gi: int, lo: int, kv: torch.Tensor) -> None:
        """Write a received drafter context ``kv`` (``[n, Lg, 2, H, D]``, absolute positions ``[lo, lo + n)``).

        Goes through the same checked store as every other drafter write: each
        position lands on ordinal ``s // P`` of the request's own row, and the
        ownership checker records it (so reads later compare against it). Every
        ordinal must be backed; otherwise ``ValueError`` and nothing is written.
        """
        group = self._groups[gi]
        c = self.config
        want = (len(group.layers), 2, c.num_kv_heads, c.head_dim)
        if kv.dim() != 5 or tuple(kv.shape[1:]) != want:
            raise ValueError(
                f"request {request_id}: a received drafter context for layer group {group.index} must be "
                f"[n, {', '.join(map(str, want))}], got {tuple(kv.shape)}"
            )
        end = lo + kv.shape[0]
        positions, pages = self.mirror_pages(request_id, gi, lo, end, "writing a received drafter context")
        P = self.meta.tokens_per_block
        kv = kv.to(device=self.device, dtype=c.dtype)
        self._write_for(request_id, gi, positions, positions // P, pages, positions % P, kv, None)

    # ------------------------------------------------------------------ executor API
    def store_context(
        self, request: LlmRequest | int, positions: torch.Tensor | Sequence[int], hidden: torch.Tensor
    ) -> None:
        """Store a context chunk's hidden states ``[n, F]`` (absolute ``positions``) as draft K/V."""
        hidden = torch.as_tensor(hidden)
        n = torch.as_tensor(positions).numel()
        if tuple(hidden.shape) != (n, self.features.feature_dim):
            raise ValueError(
                f"hidden states must be [{n}, {self.features.feature_dim}], got {tuple(hidden.shape)}"
            )
        plan = self.meta.advance_slot_for_context(request, positions)
        P = self.meta.tokens_per_block
        pos = plan.positions.to(self.device)
        offsets = plan.offsets.to(self.device)
        for gi, group in enumerate(self._groups):
            kv = self._project_group(gi, hidden, pos)
            self._write(plan.row, gi, pos, pos // P, plan.pages[group.index].to(self.device), offsets, kv)

    def commit_step(self, hidden: Mapping[int, torch.Tensor]) -> None:
        """Store the accepted tokens' hidden states of generation rows: ``{request_id: [n, F]}``.

        ``n`` (= accepted drafts + 1) tokens continue each slot at its context
        length; rows not in the mapping store nothing. Runs this step's
        preparation (fused kernel or eager path) and advances every slot.
        """
        F = self.features.feature_dim
        for rid, h in hidden.items():
            if h.dim() != 2 or h.shape[1] != F:
                raise ValueError(f"request {rid}: hidden states must be [n, {F}], got {tuple(h.shape)}")
        counts = {rid: int(h.shape[0]) for rid, h in hidden.items()}
        old_len = {rid: self.meta.slots.slot_state(rid)[0] for rid in hidden if self.meta.slots.has_slot(rid)}
        preps = self.worker._advance_ctx_len(counts)
        self.worker.finish_step()
        P = self.meta.tokens_per_block
        for rid, h in hidden.items():
            n = counts[rid]
            if n == 0:
                continue
            row = self.meta.row_index(rid)
            positions = torch.arange(old_len[rid], old_len[rid] + n, dtype=torch.int64, device=self.device)
            for gi, group in enumerate(self._groups):
                prep = preps[group.index]
                pages = prep.store_pages[row, :n].to(self.device)
                offsets = prep.store_offsets[row, :n].to(self.device)
                self._write(row, gi, positions, positions // P, pages, offsets, self._project_group(gi, h, positions))

    @torch.no_grad()
    def propose(self, bonus_tokens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """Block-decode ``block_size - 1`` drafts per row: int64 ``[B, block_size - 1]``.

        Rows that do not propose (context rows before their last chunk) get -1.
        ``bonus_tokens`` defaults to each row's ``req.tokens[-1]``.
        """
        meta, c = self.meta, self.config
        B, bs = meta.num_rows, c.block_size
        out = torch.full((B, bs - 1), -1, dtype=torch.int64, device=self.device)
        rows = [i for i, r in enumerate(meta.rows) if r.proposing]
        if not rows:
            return out
        bonus = self._bonus_tokens(bonus_tokens)
        preps = self.worker.generation_prep()
        H, D, fd = c.num_kv_heads, c.head_dim, c.feature_dim
        dev = self.device
        R = len(rows)
        ridx = torch.tensor(rows, dtype=torch.int64, device=dev)
        bonus_t = torch.tensor([bonus[i] for i in rows], dtype=torch.int64, device=dev)
        q_content = (self.E[bonus_t] @ self.W_q.reshape(fd, H * D)).reshape(R, 1, H, D)
        for gi, group in enumerate(self._groups):
            drafts = self._propose_group(gi, preps[group.index], rows, ridx, q_content)
            out[ridx[:, None], torch.tensor(group.layers, device=dev)[None, :]] = drafts
        return out

    def _bonus_tokens(self, bonus_tokens: torch.Tensor | Sequence[int] | None) -> list[int]:
        """One bonus token per row of the step (``B``): the given ones, or each row's last token."""
        meta = self.meta
        B = meta.num_rows
        if bonus_tokens is None:
            return [meta.rows[i].request.tokens[-1] for i in range(B)]
        bonus = [int(t) for t in torch.as_tensor(bonus_tokens).reshape(-1).tolist()]
        if len(bonus) != B:
            raise ValueError(f"{len(bonus)} bonus tokens for {B} rows")
        return bonus

    def _propose_group(
        self, gi: int, prep, rows: list[int], ridx: torch.Tensor, q_content: torch.Tensor,
    ) -> torch.Tensor:
        """Drafts ``[R, Lg]`` of one layer group for the proposing rows (``rows``: step row indices)."""
        c, group = self.config, self._groups[gi]
        dev, P, bs = self.device, self.meta.tokens_per_block, c.block_size
        tables = self.meta.tables[group.index].tables.to(dev)[ridx].long()  # unrebased [R, M]
        read_rows = prep.read_rows
        if self.debug_read_rows_hook is not None:
            read_rows = self.debug_read_rows_hook(group.index, read_rows)
        read_rows = read_rows.to(dev)[ridx].long()
        M = tables.shape[1]
        rl = prep.read_lens.to(dev)[ridx]
        shift = prep.shift.to(dev)[ridx]
        q = prep.query_pos.to(dev)[ridx]  # [R, bs] slot positions of the block
        q_ord = q // P
        q_in = q_ord < M
        q_pages = torch.where(q_in, tables.gather(1, torch.where(q_in, q_ord, 0)), -1)
        q_off = q % P
        # (1) append the block onto row[q // P]
        blk_kv = self._block_kv(gi, q).reshape(len(rows), bs, len(group.layers), 2, c.num_kv_heads, c.head_dim)
        for r, i in enumerate(rows):
            self._write(i, gi, q[r], q_ord[r], q_pages[r], q_off[r], blk_kv[r])
        # (2) the context within the widest window of the group, rebased coordinates
        #     (slot_start.read_window_start, per row)
        wins = [self.windows[layer] for layer in group.layers]
        widest = None if any(w is None for w in wins) else max(wins)
        ctx = self._read_context(gi, read_rows, rl, shift, widest)
        blk_read = self._gather(gi, q_pages, q_off)  # [R, bs, Lg, 2, H, D]
        if self.checker is not None:
            for r, i in enumerate(rows):
                v = ctx.valid[r]
                self._report_read(
                    i, gi, ctx.positions[r][v], ctx.ordinals[r][v] + shift[r], ctx.pages[r][v], ctx.kv[r][v]
                )
                self._report_read(i, gi, q[r], q_ord[r], q_pages[r], blk_read[r])
        keys = torch.cat([ctx.kv, blk_read], dim=1)  # [R, K, Lg, 2, H, D]
        key_ok = self._key_mask(ctx, rl, wins, widest)
        return self._attend(gi, q, q_content, keys, key_ok)

    def _read_context(
        self, gi: int, read_rows: torch.Tensor, rl: torch.Tensor, shift: torch.Tensor, widest: int | None,
    ) -> _ContextRead:
        """Gather each row's context within the group's widest window (``None``: all of ``[0, read_len)``).

        ``read_rows`` ``[R, M]`` are the rows rebased past each slot's base, ``rl`` the read lengths and
        ``shift`` the bases in pages; positions are computed rebased, then shifted back to slot positions.
        """
        P, bs = self.meta.tokens_per_block, self.config.block_size
        t0 = torch.zeros_like(rl) if widest is None else (rl + bs - widest).clamp_min(0)
        lens = (rl - t0).clamp_min(0)
        width = int(lens.max())
        j = torch.arange(width, dtype=torch.int64, device=self.device)[None, :]
        t = t0[:, None] + j
        valid = j < lens[:, None]
        r_ord = torch.where(valid, t // P, 0)
        ctx_pages = torch.where(valid, read_rows.gather(1, r_ord), -1) if width else r_ord
        ctx_pos = t + shift[:, None] * P
        ctx_kv = self._gather(gi, ctx_pages, ctx_pos % P)  # [R, width, Lg, 2, H, D]
        return _ContextRead(t, valid, r_ord, ctx_pages, ctx_pos, ctx_kv, width)

    def _key_mask(
        self, ctx: _ContextRead, rl: torch.Tensor, wins: list, widest: int | None,
    ) -> torch.Tensor:
        """``[R, Lg, width + bs]`` the keys each layer attends: the context inside its own window, the whole block."""
        bs = self.config.block_size
        R, Lg, width = rl.shape[0], len(wins), ctx.width
        # per-layer window masks (the span read is the widest one)
        key_ok = torch.cat([ctx.valid, torch.ones(R, bs, dtype=torch.bool, device=self.device)], dim=1)[:, None, :]
        key_ok = key_ok.expand(R, Lg, width + bs).clone()
        for li, w in enumerate(wins):
            if w is not None and w != widest:
                lo = (rl + bs - w).clamp_min(0)[:, None]
                key_ok[:, li, :width] &= ctx.rebased >= lo
        return key_ok

    def _attend(
        self, gi: int, q: torch.Tensor, q_content: torch.Tensor, keys: torch.Tensor, key_ok: torch.Tensor,
    ) -> torch.Tensor:
        """Drafts ``[R, Lg]``: the block's queries at slot positions ``q`` ``[R, bs]`` attend ``keys``."""
        c, group = self.config, self._groups[gi]
        H, D, fd, bs = c.num_kv_heads, c.head_dim, c.feature_dim, c.block_size
        R, Lg, dev = q.shape[0], len(group.layers), self.device
        # (3) queries: the bonus token's content, the rotary pair at the query positions
        qv = q_content.expand(R, bs, H, D).clone()
        qv[..., fd : fd + 2] = self._rotary(q)
        k = keys[:, :, :, 0].permute(0, 2, 3, 4, 1)  # [R, Lg, H, D, K]
        v_ = keys[:, :, :, 1].permute(0, 2, 3, 1, 4)  # [R, Lg, H, K, D]
        scores = qv.permute(0, 2, 1, 3)[:, None] @ k  # [R, Lg, H, bs, K]
        scores = scores.masked_fill(~key_ok[:, :, None, None, :], float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        blk_out = (attn @ v_).mean(dim=2)  # [R, Lg, bs, D]
        sel = torch.tensor([layer + 1 for layer in group.layers], device=dev)  # draft l+1 <- layer l
        picked = blk_out[:, torch.arange(Lg, device=dev), sel, :fd]  # [R, Lg, fd]
        return torch.argmax(picked @ self.E.T, dim=-1)  # [R, Lg]

    # ------------------------------------------------------------------ inspection
    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def group_layers(self, gi: int) -> tuple[int, list[int]]:
        """``(pool group index, drafter layers)`` of the drafter's ``gi``-th layer group."""
        group = self._groups[gi]
        return group.index, list(group.layers)

    def layer_storage(self, layer: int) -> tuple[int, torch.Tensor]:
        """``(pool index, storage [pages, 2, H, P, D])`` of one layer."""
        for g in self._groups:
            if layer in g.layers:
                return g.index, g.storages[g.layers.index(layer)]
        raise IndexError(f"layer {layer} out of range")


__all__ = ["DFlashDrafter", "DFlashDrafterConfig"]
