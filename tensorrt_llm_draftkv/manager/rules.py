"""The sizing rules, each written once, as small pure functions.

The step headroom (what a context chunk or a generation step puts above
history), the draft mirror's view, capacity and history under the `history`
rules (the fix, default) and the `legacy` rules (pre-fix, kept selectable to
reproduce the failures side by side), and the trail page. The managers, the
estimators, admission and the planner all ask these. Every position is an
absolute token position; capacities and histories are token counts from 0.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..config import ParsableEnum, SpeculativeDecodingMode
from ..request import ContextView, target_view


class MirrorSizing(ParsableEnum):
    HISTORY = "history"
    LEGACY = "legacy"

    @classmethod
    def _kind(cls) -> str:
        return "mirror sizing"


@dataclass(frozen=True)
class DraftPoolTraits:
    """What the draft manager knows about itself when it sizes a mirror."""

    mode: SpeculativeDecodingMode
    sizing: MirrorSizing = MirrorSizing.HISTORY
    joint_kv_cache_reuse: bool = False


def mirror_uses_draft_view(policy: DraftPoolTraits) -> bool:
    """Does the draft mirror read the request's draft view (else the target view)?

    A pool that joins the target's block reuse shares the target's progress, so it
    reads the target view under both sizings (upstream's `request_context(not joint,
    batch)`). Otherwise, the fix: only an external drafter (PARD, DFlash, DSpark,
    draft-target one-model) reads the target view, because no separate engine
    advances its draft view; legacy: every drafter reads the draft view.
    """
    if policy.joint_kv_cache_reuse:
        return False
    if policy.sizing is MirrorSizing.LEGACY:
        return True
    return not policy.mode.is_external_drafter()


def generation_headroom(draft_tokens: int, extra_tokens: int) -> int:
    """Tokens a generation step puts above history: the new token, the draft slots, the extra tokens."""
    return 1 + draft_tokens + extra_tokens


def context_headroom(chunk: int, is_last_chunk: bool, draft_tokens: int, extra_tokens: int) -> int:
    """Tokens a context chunk puts above its start: the chunk and the extra tokens, drafts on the last chunk."""
    return chunk + extra_tokens + (draft_tokens if is_last_chunk else 0)


def step_headroom(chunk: int, draft_tokens: int = 0, extra_tokens: int = 0) -> int:
    """The most tokens any step puts above history (a last chunk, or a generation step)."""
    if chunk < 0 or draft_tokens < 0 or extra_tokens < 0:
        raise ValueError(
            f"chunk ({chunk}), max_draft_len ({draft_tokens}) and num_extra_kv_tokens "
            f"({extra_tokens}) must be >= 0"
        )
    return max(context_headroom(chunk, True, draft_tokens, extra_tokens), generation_headroom(draft_tokens, extra_tokens))


def context_capacity(start: int, chunk: int, is_last_chunk: bool, draft_tokens: int, extra_tokens: int) -> int:
    """Tokens the mirror must hold for the chunk `[start, start + chunk)`: extra always, drafts on the last."""
    return start + context_headroom(chunk, is_last_chunk, draft_tokens, extra_tokens)


def context_history(policy: DraftPoolTraits, *, start: int, mirror_covers_start: bool) -> int | None:
    """History to pass with a context resize, or None for the old `resize(capacity)`.

    `mirror_covers_start`: the mirror already holds `[0, start)` (it computed the
    earlier chunks, or the pool holds them through joint block reuse).
    """
    # MTP, Eagle3 and two-engine drafters keep the old resize, whichever view they read.
    if policy.sizing is MirrorSizing.LEGACY or not policy.mode.is_external_drafter():
        return None
    if mirror_covers_start or start == 0:
        return start
    # First seen past 0: DFlash/DSpark store the chunk at its target position over
    # a base hiding the prefix, so the prefix is history they never read.
    if policy.mode.keeps_trail_page():
        return start
    return None


def after_step_sizing(
    tokens: int, history_length: int, capacity: int | None = None, headroom: int = 1
) -> tuple[int, int]:
    """(capacity, history) once a step is over, in absolute tokens: history = `tokens` − 1 (the last
    token has no KV yet), never below the cache's `history_length`. Capacity drops the step's
    rejected draft slots down to the next token's slot (history + 1), except those the next
    generation step reserves again anyway: it keeps up to `history + headroom` of the cache's
    current `capacity` (None: keep nothing above history + 1), so a step that does not move past
    a page does not release a page only for the next `prepare_resources` to take it back."""
    return after_step_sizes([tokens], [history_length], None if capacity is None else [capacity], headroom)[0]


def after_step_sizes(
    tokens: Sequence[int], history_lengths: Sequence[int], capacities: Sequence[int] | None = None,
    headroom: int = 1,
) -> list[tuple[int, int]]:
    """`after_step_sizing` for a whole batch, in one call (it runs for every request of every step)."""
    histories = [t - 1 if t - 1 > h else h for t, h in zip(tokens, history_lengths)]
    if capacities is None or headroom <= 1:
        return [(h + 1 if h >= 0 else 0, h) for h in histories]
    # max(h + 1, min(c, h + headroom)), as conditionals: this runs for every request of every step
    return [(h + headroom if c > h + headroom else (c if c > h + 1 else h + 1), h)
            for h, c in zip(histories, capacities)]


def disagg_gen_init_sizing(
    policy: DraftPoolTraits, *, prompt_len: int, generation_headroom: int, draft_tokens: int, extra_tokens: int
) -> tuple[int, int | None]:
    """(capacity, history) of a generation worker's new mirror.

    The fix: absolute coordinates, the transferred prompt is history (its drafter
    K/V does not exist here), so a window trims the mirror to its tail. Legacy:
    presented like a whole-prompt context chunk from position 0.
    """
    if policy.sizing is MirrorSizing.LEGACY:
        return context_capacity(0, prompt_len, True, draft_tokens, extra_tokens), None
    return prompt_len + generation_headroom, prompt_len


def dummy_history(policy: DraftPoolTraits, history_hint: int | None) -> int | None:
    """The fix gives a warmup dummy's mirror the target's history hint; legacy drops it."""
    return None if policy.sizing is MirrorSizing.LEGACY else history_hint


def draft_slot_trail_tokens(
    policy: DraftPoolTraits, *, tokens_per_block: int, any_windowed_group: bool, trail_page: bool = True
) -> int:
    """Tokens kept below every window of a DFlash/DSpark draft pool (one page), else 0.

    A drafter slot seeded at the first position of the page holding its request's
    position trails the request by up to P - 1 tokens; the extra page keeps the far
    edge of its window on pages the request holds.
    """
    if not trail_page or policy.sizing is MirrorSizing.LEGACY:
        return 0
    if not policy.mode.keeps_trail_page() or not any_windowed_group:
        return 0
    return tokens_per_block


@dataclass(frozen=True)
class StepSizing:
    """One manager's sizing, one function per phase, from the rules above.

    `policy=None` is a target cache's own sizing; a `DraftPoolTraits` is a draft
    mirror's. Every answer is `(capacity, history)` in absolute tokens, history
    None meaning "keep the cache's" (the old `resize(capacity)`).
    """

    max_draft_len: int = 0
    num_extra_kv_tokens: int = 0
    policy: DraftPoolTraits | None = None

    @property
    def reads_draft_view(self) -> bool:
        return self.policy is not None and mirror_uses_draft_view(self.policy)

    @property
    def generation_headroom(self) -> int:
        return generation_headroom(self.max_draft_len, self.num_extra_kv_tokens)

    def view(self, req) -> ContextView:
        """The (position, chunk) the cache is sized from.

        A mirror that reads the draft view reads it through the request's context
        properties: what the open `request_context` makes the request present.
        Everything else reads the target view, whatever `use_draft_model` says.
        """
        if self.reads_draft_view:
            return ContextView(req.context_current_position, req.context_chunk_size)
        return target_view(req)

    def context(self, req, cache, chunk: int | None = None) -> tuple[int, int | None]:
        """The current context chunk `[start, start + chunk)` of the view (`chunk`: the scheduler's
        token count instead of the view's chunk size)."""
        view = self.view(req)
        size = view.chunk_size if chunk is None else chunk
        is_last = view.position + size >= req.prompt_len
        capacity = context_capacity(view.position, size, is_last, self.max_draft_len, self.num_extra_kv_tokens)
        if self.policy is None:
            return capacity, None
        # Covers [0, start): it computed the earlier chunks, or joint reuse holds them.
        covers = self.policy.joint_kv_cache_reuse or (cache.capacity >= view.position and cache.num_blocks > 0)
        history = context_history(self.policy, start=view.position, mirror_covers_start=covers)
        if history is not None:
            history = max(history, cache.history_length)
        return max(capacity, cache.history_length), history

    def generation(self, req, cache) -> tuple[int, int | None]:
        """A generation step: the new token, drafts and extra tokens above `tokens - 1`."""
        return req.max_beam_num_tokens - 1 + self.generation_headroom, None

    def generation_sizes(self, reqs: Sequence) -> list[tuple[int, None]]:
        """`generation` for a whole batch (it reads no cache): the headroom found once."""
        above = self.generation_headroom - 1
        return [(req.max_beam_num_tokens + above, None) for req in reqs]

    def disagg_gen_init(self, req, cache) -> tuple[int, int | None]:
        """A generation worker's new request (see `disagg_gen_init_sizing`)."""
        if self.policy is None:
            return req.prompt_len + self.generation_headroom, req.prompt_len
        return disagg_gen_init_sizing(
            self.policy,
            prompt_len=req.prompt_len,
            generation_headroom=self.generation_headroom,
            draft_tokens=self.max_draft_len,
            extra_tokens=self.num_extra_kv_tokens,
        )

    @property
    def disagg_gen_init_phase(self) -> str:
        """The phase resize errors name: legacy presents the request as a whole-prompt context chunk."""
        legacy = self.policy is not None and self.policy.sizing is MirrorSizing.LEGACY
        return "context" if legacy else "generation"

    def dummy_history(self, history_hint: int | None) -> int | None:
        """A warmup dummy's history: the hint (legacy mirrors drop it)."""
        return history_hint if self.policy is None else dummy_history(self.policy, history_hint)


def drafter_window_hit_cap(prompt_len: int, draft_windows: tuple[int | None, ...], tokens_per_block: int) -> int:
    """Most tokens (a whole number of pages, from position 0) a target-only prefix hit may skip
    so that the drafter still computes every position it reads at the prompt end.

    At the first generation step (position `m = prompt_len`) a windowed draft group
    reads `[m + 1 - W, m)`; its context is computed from the hit `h` on, so
    `h <= m + 1 - W`, rounded down to a page. A full-attention draft group reads
    the whole prompt: 0. Under joint reuse the draft pool holds the prefix's
    drafter K/V itself and no cap applies.
    """
    if not draft_windows:
        return prompt_len
    P = tokens_per_block
    caps = [0 if w is None else max(0, prompt_len + 1 - w) // P * P for w in draft_windows]
    return min(caps)

