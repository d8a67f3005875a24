"""The text of resize errors: what was asked, and what every live cache holds."""
from __future__ import annotations

from collections.abc import Sequence

from typing import Mapping

from ..runtime import KVCache


class KVCacheResizeError(RuntimeError):
    """A request's cache could not be resized; the message carries the pool diagnostic."""

    def __init__(self, message: str, *, request_id: int, phase: str, capacity: int, history: int | None):
        super().__init__(message)
        self.request_id = request_id
        self.phase = phase
        self.capacity = capacity
        self.history = history


class MissingKVCacheError(KeyError):
    """A call named requests that hold no cache; nothing was changed.

    A KeyError (as an unknown id is), printed as its plain message.
    """

    def __init__(self, message: str, *, request_ids: list[int]) -> None:
        super().__init__(message)
        self.message = message
        self.request_ids = request_ids

    def __str__(self) -> str:
        return self.message


def pool_diagnostic(
    caches: Mapping[int, KVCache], windows: tuple[int | None, ...], free_pages: tuple[int, ...], total_pages: tuple[int, ...]
) -> str:
    """One line per live cache (capacity, history, logical blocks, pages held), then the pools.

    `windows` are the windows the pool releases pages by: on a DFlash/DSpark draft pool each is the
    drafter's window widened by the trail page (a 1024-token window over 32-token pages shows 1056).
    """
    lines = [
        f"  attention windows as the pool keeps them (tokens; a draft pool's include its trail page; "
        f"None = full attention): {list(windows)}"
    ]
    lines.append(
        "  pages free per layer group: "
        + ", ".join(f"group {g}: {free}/{total}" for g, (free, total) in enumerate(zip(free_pages, total_pages)))
    )
    lines.append(f"  live caches: {len(caches)}")
    for request_id, cache in sorted(caches.items()):
        held = [cache.num_held_pages(g) for g in range(len(cache.groups))]
        lines.append(
            f"    request {request_id}: capacity={cache.capacity} history={cache.history_length} "
            f"logical_blocks={cache.num_blocks} held_pages={held}"
        )
    return "\n".join(lines)


def resize_error(
    *,
    label: str,
    request_id: int,
    phase: str,
    capacity: int,
    history: int | None,
    diagnostic: str,
    step: str = "",
    pages_needed: Sequence[int] | None = None,
    pages_free: Sequence[int] | None = None,
) -> KVCacheResizeError:
    """`<label> <phase> resize failed for request N: could not resize to C tokens ...`; `step` says
    which step asked (a context chunk's range, and a hint when it is the whole prompt);
    `pages_needed`/`pages_free` (per layer group) say by how many pages it falls short."""
    hist = "unchanged" if history is None else str(history)
    pages = ""
    if pages_needed is not None and pages_free is not None:
        short = [g for g, (n, f) in enumerate(zip(pages_needed, pages_free)) if n > f]
        pages = (
            f"  pages this resize needs per layer group: {list(pages_needed)}, free: {list(pages_free)}"
            + (f" (layer group {short[0]} is {pages_needed[short[0]] - pages_free[short[0]]} pages short)" if short else "")
            + "\n"
        )
    message = (
        f"{label} {phase} resize failed for request {request_id}: could not resize to {capacity} tokens "
        f"(history {hist})\n{step + chr(10) if step else ''}{pages}{diagnostic}"
    )
    return KVCacheResizeError(message, request_id=request_id, phase=phase, capacity=capacity, history=history)


def context_step(start: int, chunk: int, prompt_len: int, *, draft_view: bool) -> str:
    """The line saying what a context resize was for, with the way out when the chunk is the whole
    prompt. `draft_view`: the sizes came from the request's draft view (only a separate draft engine
    advances it, so chunking the prefill does not change them)."""
    view = "draft view" if draft_view else "target view"
    text = f"  for the context chunk [{start}, {start + chunk}) of a {prompt_len}-token prompt ({view})"
    if start == 0 and chunk >= prompt_len > 1:
        if draft_view:
            text += ": the draft view presents the whole prompt as one chunk (the pre-fix sizing of a drafter in the target's engine)"
        else:
            text += (": the whole prompt as one chunk; set the request's context_chunk_size to prefill it in "
                     "chunks (chunked prefill), or give the pool more pages")
    return text
