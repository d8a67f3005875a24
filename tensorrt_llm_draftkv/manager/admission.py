"""Admission: is a request's draft mirror covered by the per-request charge?

A pool is sized as the estimator's per-request charge (`budget.group_pages_per_request`)
times the requests it admits. The charge is exact only under its assumptions; a
request outside them can hold more pages than it was charged, and a pool sized at
the charge then fails that request's resize half-way through its prefill. This
module replays, for one request, the (capacity, history) resizes the managers
make, gives the exact largest number of pages its mirror will hold in the prompt
phase (and an upper bound for its generation steps), and builds the explicit
refusal for a request whose peak exceeds the charge, before any page is taken.

Coordinates: capacities, histories, prompt lengths and chunk starts are absolute
token positions (token counts from position 0); page counts are per layer group,
in pages of `tokens_per_block` (P) tokens.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..config import LayerGroupConfig
from ..runtime.life_cycle import LifeCycle
from . import rules
from .budget import group_pages_per_request


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class AdmissionRefused(ValueError):
    """A request whose mirror would hold more pages than the estimator charges it.

    Raised before anything is allocated. `group` is the first layer group over its
    charge; `needed_pages` and `charged_pages` are that group's page counts.
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: int,
        group: int,
        needed_pages: int,
        charged_pages: int,
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.group = group
        self.needed_pages = needed_pages
        self.charged_pages = charged_pages


# -- the charge -----------------------------------------------------------------------------
def request_charge(
    layer_groups: Sequence[LayerGroupConfig],
    tokens_per_block: int,
    *,
    chunk: int,
    max_seq_len: int,
    max_draft_len: int = 0,
    num_extra_kv_tokens: int = 0,
    trail_tokens: int = 0,
    aligned: bool = True,
) -> tuple[int, ...]:
    """Pages per layer group the estimator charges one request (what a pool is sized by).

    `layer_groups` carry the model's windows (in tokens, not yet widened) and sink
    blocks; `trail_tokens` is the pool's trail (P on a DFlash/DSpark draft pool with
    a windowed group, else 0) and widens every window, as the pool's life cycles do.

    The charge's assumption, with `aligned=True`: context chunks start at multiples
    of `chunk` from position 0, so every chunk start (every history a context step
    starts from) is ≡ 0 mod gcd(chunk, P); a request whose chunks start elsewhere
    (a prefix computed elsewhere ending off that residue) may need one page more.
    `aligned=False` charges the worst residue instead (an upper bound for every
    chunk start). Either way the charge assumes a mirror that covers `[0, start)`
    or is sized with history from its first chunk, and never exceeds the
    full-attention charge for `max_seq_len` tokens.
    """
    return tuple(
        group_pages_per_request(
            g.window,
            tokens_per_block,
            max_seq_len=max_seq_len,
            chunk=chunk,
            max_draft_len=max_draft_len,
            num_extra_kv_tokens=num_extra_kv_tokens,
            trail_tokens=trail_tokens,
            sink_blocks=g.sink_blocks,
            chunk_alignment=aligned,
        )
        for g in layer_groups
    )


# -- the mirror's own peak ---------------------------------------------------------------
def held_pages(life_cycle: LifeCycle, tokens_per_block: int, capacity: int, history: int) -> int:
    """Pages one layer group of a cache holds at `capacity` tokens, `history` of them history.

    Every block ordinal below `ceil(capacity / P)` is backed except the stale range of
    `history` (the sink blocks stay). Stale ranges only grow with history, so this is
    what a KVCache holds whatever resizes led to (capacity, history).
    """
    if capacity < history:
        raise ValueError(f"capacity {capacity} is below history {history}")
    lo, hi = life_cycle.stale_range(history, tokens_per_block)
    return _ceil_div(capacity, tokens_per_block) - (hi - lo)


def _check_request(prompt_len: int, start: int, chunk: int) -> None:
    if prompt_len < 1 or chunk < 1:
        raise ValueError(f"prompt_len ({prompt_len}) and chunk ({chunk}) must be >= 1")
    if not 0 <= start < prompt_len:
        raise ValueError(f"the first chunk must start in [0, prompt_len={prompt_len}), got start={start}")


def prompt_phase_sizes(
    policy: rules.DraftPoolTraits | None,
    *,
    prompt_len: int,
    chunk: int,
    start: int = 0,
    max_draft_len: int = 0,
    num_extra_kv_tokens: int = 0,
    disagg_generation_init: bool = False,
) -> list[tuple[int, int]]:
    """Every (capacity, history) a new mirror takes until its first generation step.

    A context request: per chunk `[s, s + c)` at `s = start, start + chunk, ...` with
    `c = min(chunk, prompt_len - s)`, the prepare's resize (`rules.context_capacity`,
    `rules.context_history`, exactly as `DraftKVCacheManagerV2._context_sizing`),
    then `update_context_resources` (history to `s + c`); after the last chunk,
    `update_resources` (history `prompt_len`, capacity `prompt_len + 1`). A
    disaggregated generation-init request: the one resize of
    `rules.disagg_gen_init_sizing`. A mirror that reads the draft view is assumed to
    see the same chunks (its drafter keeps the draft view in step with the target's).
    `policy=None` replays the target cache's own sizing (no history with a context
    resize; the prompt as history at generation-init). O(number of chunks).
    """
    _check_request(prompt_len, start, chunk)
    d, e = max_draft_len, num_extra_kv_tokens
    if disagg_generation_init:
        if policy is None:
            return [(prompt_len + rules.generation_headroom(d, e), prompt_len)]
        capacity, history = rules.disagg_gen_init_sizing(
            policy, prompt_len=prompt_len, generation_headroom=rules.generation_headroom(d, e), draft_tokens=d, extra_tokens=e
        )
        return [(capacity, 0 if history is None else history)]
    sizes: list[tuple[int, int]] = []
    cap, hist = 0, 0
    s = start
    while True:
        c = min(chunk, prompt_len - s)
        last = s + c >= prompt_len
        wanted = rules.context_capacity(s, c, last, d, e)
        h = None
        if policy is not None:
            covers = policy.joint_kv_cache_reuse or (cap >= s and cap > 0)
            h = rules.context_history(policy, start=s, mirror_covers_start=covers)
        cap, hist = max(wanted, hist), (hist if h is None else max(h, hist))
        sizes.append((cap, hist))
        if s + c > hist:  # update_context_resources: history follows the view
            cap, hist = max(cap, s + c), s + c
            sizes.append((cap, hist))
        if last:
            break
        s += c
    hist = max(prompt_len, hist)  # update_resources after the first token
    sizes.append((hist + 1, hist))
    return sizes


def generation_peak_pages(
    life_cycle: LifeCycle,
    tokens_per_block: int,
    *,
    prompt_len: int,
    history: int,
    generation_headroom: int,
    max_new_tokens: int | None = None,
) -> int:
    """The most pages one group holds over the generation steps (0 if there are none).

    The first step sits at capacity `prompt_len + generation_headroom` over the
    `history` the prompt phase left (the first token is already generated). Every
    later step starts from history h = tokens - 1 with h in `[prompt_len + 1,
    prompt_len + max_new_tokens - 2]` at `(h + headroom, h)`, and every update leaves
    `(h + 1, h)` up to h = `prompt_len + max_new_tokens - 1`. The maximum over those
    histories is exact when every step accepts no draft (each h is visited) and an
    upper bound otherwise. `max_new_tokens=None`: no length limit; a windowed group
    then peaks at the unaligned windowed count plus its sinks, and a full-attention
    group has no bound (ValueError). O(P).
    """
    p, gh = tokens_per_block, generation_headroom
    if max_new_tokens is not None and max_new_tokens < 2:
        return 0  # the context phase (or the context worker) produced the only token
    if max_new_tokens is None and life_cycle.window is None:
        raise ValueError("a full-attention group grows with every generated token: give max_new_tokens")
    first = held_pages(life_cycle, p, prompt_len + gh, history)
    a = prompt_len + 1
    b = None if max_new_tokens is None else prompt_len + max_new_tokens - 2
    peak = first
    if b is not None:
        end = b + 1  # the last update: history prompt_len + max_new_tokens - 1
        peak = max(peak, held_pages(life_cycle, p, end + 1, end))
        if b < a:
            return peak

    def step(h: int) -> int:
        return held_pages(life_cycle, p, h + gh, h)

    if life_cycle.window is None:
        return max(peak, step(b))  # nothing is released: the last step holds the most
    # Below h0 nothing is stale (the count only grows with h); from h0 on it is periodic in P.
    h0 = life_cycle.window - 1 + (life_cycle.sink_blocks + 1) * p
    if a < h0:
        peak = max(peak, step(h0 - 1 if b is None else min(b, h0 - 1)))
    lo = max(a, h0)
    hi = lo + p - 1 if b is None else min(b, lo + p - 1)
    for h in range(lo, hi + 1):
        peak = max(peak, step(h))
    return peak


def mirror_peak_pages(
    policy: rules.DraftPoolTraits | None,
    life_cycles: Sequence[LifeCycle],
    tokens_per_block: int,
    *,
    prompt_len: int,
    chunk: int,
    start: int = 0,
    max_draft_len: int = 0,
    num_extra_kv_tokens: int = 0,
    disagg_generation_init: bool = False,
    max_new_tokens: int | None = None,
    include_generation: bool = True,
) -> tuple[int, ...]:
    """The largest number of pages per layer group this request's mirror will hold.

    `policy` is the mirror's (None: the target cache's own sizing); `life_cycles`
    are the pool's own (windows already widened by the trail tokens; sinks). The
    request has `prompt_len` tokens; as a context request its first chunk starts at
    absolute position `start` (0 normally, > 0 after a prefix this worker did not
    compute) and its chunks are `[start + k * chunk, ...)`; as a disaggregated
    generation-init request (`disagg_generation_init`) `start` is ignored. The
    prompt phase (`prompt_phase_sizes`) is exact; with `include_generation` the
    generation steps, up to `max_new_tokens` generated tokens in all, add
    `generation_peak_pages` (exact for single-token steps, an upper bound for any).
    """
    sizes = prompt_phase_sizes(
        policy,
        prompt_len=prompt_len,
        chunk=chunk,
        start=start,
        max_draft_len=max_draft_len,
        num_extra_kv_tokens=num_extra_kv_tokens,
        disagg_generation_init=disagg_generation_init,
    )
    peaks = []
    for lc in life_cycles:
        peak = max(held_pages(lc, tokens_per_block, c, h) for c, h in sizes)
        if include_generation:
            generation = generation_peak_pages(
                lc,
                tokens_per_block,
                prompt_len=prompt_len,
                history=sizes[-1][1],
                generation_headroom=rules.generation_headroom(max_draft_len, num_extra_kv_tokens),
                max_new_tokens=max_new_tokens,
            )
            peak = max(peak, generation)
        peaks.append(peak)
    return tuple(peaks)


# -- the refusal ---------------------------------------------------------------------------
def _why(
    policy: rules.DraftPoolTraits | None,
    tokens_per_block: int,
    *,
    prompt_len: int,
    start: int,
    chunk: int,
    max_draft_len: int,
    num_extra_kv_tokens: int,
    disagg_generation_init: bool,
    prompt_phase_over: bool,
    max_new_tokens: int | None,
) -> str:
    if not prompt_phase_over:
        return (
            f"its generation steps (up to {max_new_tokens} new tokens, {rules.generation_headroom(max_draft_len, num_extra_kv_tokens)} "
            "token slots of headroom above history) pass what the charge allows (its cap at the full-attention "
            "count for max_seq_len leaves out the step headroom)"
        )
    if disagg_generation_init:
        if policy is not None and policy.sizing is rules.MirrorSizing.LEGACY:
            return "the legacy rules size it as a whole-prompt chunk from position 0, with no history"
        return "its prompt and one step of headroom need more than the charge covers (max_seq_len or geometry)"
    first = min(chunk, prompt_len - start)
    no_history = policy is None or (
        rules.context_history(policy, start=start, mirror_covers_start=policy.joint_kv_cache_reuse) is None
    )
    if start > 0 and no_history:
        capacity = rules.context_capacity(start, first, start + first >= prompt_len, max_draft_len, num_extra_kv_tokens)
        who = "a target cache" if policy is None else f"a {policy.mode.label} mirror"
        rules_used = "" if policy is None else f" under the {policy.sizing.value} rules"
        return (
            f"{who} first seen past position 0 keeps the old sizing{rules_used} (no history), "
            f"so it backs every page of [0, {capacity}) at once"
        )
    g = math.gcd(chunk, tokens_per_block)
    if start % g:
        return (
            f"its chunks start at {start} + k*{chunk}, which is {start % g} mod gcd(chunk, P) = {g}, while the "
            f"aligned charge assumes chunks at multiples of the chunk from position 0 (every start 0 mod {g}); "
            "the unaligned charge (aligned=False) allows every chunk start"
        )
    return "its prompt with the step headroom passes what the charge covers (its cap at max_seq_len, or other geometry)"


def check_request(
    policy: rules.DraftPoolTraits | None,
    life_cycles: Sequence[LifeCycle],
    tokens_per_block: int,
    *,
    request_id: int,
    charged: Sequence[int],
    prompt_len: int,
    chunk: int,
    start: int = 0,
    max_draft_len: int = 0,
    num_extra_kv_tokens: int = 0,
    disagg_generation_init: bool = False,
    max_new_tokens: int | None = None,
    label: str = "Draft KV cache",
    pool_pages: Sequence[int] | None = None,
) -> None:
    """Raise `AdmissionRefused` if `mirror_peak_pages` exceeds `charged` (pages per group) anywhere, or
    or, within the charge, the pool itself (`pool_pages`, its pages per group, when given).

    Arguments as for `mirror_peak_pages`. The message names the request, where its
    chunks start and their size (or that it is a generation-init request), both
    page counts of the first group over its charge (or over its pool), and why.
    A charge is a geometry's figure; `pool_pages` is what this pool has: a request
    within the charge is still refused by a pool smaller than its peak. Changes nothing.
    """
    kwargs = dict(
        prompt_len=prompt_len,
        chunk=chunk,
        start=start,
        max_draft_len=max_draft_len,
        num_extra_kv_tokens=num_extra_kv_tokens,
        disagg_generation_init=disagg_generation_init,
    )
    needed = mirror_peak_pages(policy, life_cycles, tokens_per_block, max_new_tokens=max_new_tokens, **kwargs)
    if len(needed) != len(charged):
        raise ValueError(f"a charge of {len(charged)} page counts for {len(needed)} layer groups")
    what = (
        f"a disaggregated generation-init request of {prompt_len} prompt tokens"
        if disagg_generation_init
        else f"a context request of {prompt_len} tokens starting at position {start} in chunks of {chunk}"
    )
    if pool_pages is not None and len(pool_pages) != len(needed):
        raise ValueError(f"pool sizes for {len(pool_pages)} layer groups, the request has {len(needed)}")
    over = [g for g, (n, c) in enumerate(zip(needed, charged)) if n > c]
    if not over:
        if pool_pages is not None:
            _check_pool(needed, pool_pages, charged, life_cycles, tokens_per_block, request_id, what, label)
        return
    g = over[0]
    prompt_phase = mirror_peak_pages(policy, life_cycles, tokens_per_block, include_generation=False, **kwargs)
    why = _why(
        policy,
        tokens_per_block,
        prompt_phase_over=prompt_phase[g] > charged[g],
        max_new_tokens=max_new_tokens,
        **kwargs,
    )
    window = life_cycles[g].window
    message = (
        f"{label}: request {request_id} refused at admission: {what} needs {needed[g]} pages in layer "
        f"group {g} (window {window} tokens, P {tokens_per_block}) but the estimator charges {charged[g]} "
        f"pages per request; why: {why}. Per group: needs {list(needed)}, charged {list(charged)}. "
        "Admitted, it would fail its resize in a pool sized at the charge."
    )
    raise AdmissionRefused(message, request_id=request_id, group=g, needed_pages=needed[g], charged_pages=charged[g])


def _check_pool(
    needed: Sequence[int], pool_pages: Sequence[int], charged: Sequence[int], life_cycles: Sequence[LifeCycle],
    tokens_per_block: int, request_id: int, what: str, label: str,
) -> None:
    """`AdmissionRefused` for a request within its charge whose peak a layer group's pool cannot hold."""
    small = [g for g, (n, total) in enumerate(zip(needed, pool_pages)) if n > total]
    if not small:
        return
    g = small[0]
    message = (
        f"{label}: request {request_id} refused at admission: {what} needs {needed[g]} pages in layer "
        f"group {g} (window {life_cycles[g].window} tokens, P {tokens_per_block}) but the pool has only "
        f"{pool_pages[g]} pages (the charge, {charged[g]} pages per request, is the geometry's figure, "
        f"not this pool's). Per group: needs {list(needed)}, pool {list(pool_pages)}."
    )
    raise AdmissionRefused(message, request_id=request_id, group=g, needed_pages=needed[g], charged_pages=charged[g])
