"""The drafter-context handoff of disaggregated serving: what a context worker sends for the drafter.

A DFlash/DSpark generation worker used to start every request with an empty
drafter context, because the drafter's K/V for the prompt was computed (or not)
on the context worker. This module describes what the context worker sends so
the generation worker's drafter can read the prompt as an aggregated drafter
would, and nothing more.

Coordinates: absolute token positions of the request (position 0 is the first
prompt token) and block ordinals ``i`` covering ``[i*P, (i+1)*P)``. For a prompt
of ``m`` tokens the generation worker's mirror has history ``m``; in a draft
layer group whose pool keeps ``K = W + T`` tokens (the drafter window ``W``
widened by the trail tokens ``T``, one page on a DFlash/DSpark pool) it backs
every ordinal from ``(m + 1 - K) // P`` up. The drafter reads at most the last
``W`` positions below its block, so the context worker sends, per group,

* windowed group: positions ``[max(0, m + 1 - K), m)`` (``K - 1`` positions,
  the trail page included). They touch every page the mirror backs below ``m``
  and no other (the first of those pages only from ``m + 1 - K`` up): never a
  position on a released page. The drafter's reads start at ``m + block - W``
  or later, above the first sent position;
* full-attention group: ``[0, m)``.

Two forms carry the same information:

* ``kv`` (form a, the default): the drafter's K/V as stored in the draft pool,
  ``[n, layers, 2, kv_heads, head_dim]`` per group, written verbatim;
* ``hidden`` (form b): the target hidden states the drafter projects,
  ``[n, hidden_size]`` once for the union of the groups' ranges; the
  generation worker computes the K/V itself.

:func:`handoff_bytes` gives both sizes (and the whole-prompt cost) for a
geometry, so the smaller one can be chosen per deployment.

The wire header is :class:`DrafterContextGeometry` as a fixed-size list of
integers, version first. A receiver checks it against its own with
:meth:`DrafterContextGeometry.check_compatible`, which raises
:class:`DrafterContextMismatch` naming both geometries. The receiver's checks
before seeding a slot (:func:`check_seed_range`, :func:`mirror_backed_from`)
live in :mod:`.handoff_seed`.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..config import ParsableEnum, parse_dtype
from .draft_pool import DraftPool

#: Bumped whenever the meaning or layout of the wire header changes.
HANDOFF_VERSION = 1
#: Most draft layer groups one header describes.
MAX_HANDOFF_GROUPS = 8
#: Integers of the wire header (fixed size, so a receiver can post one receive).
HEADER_INTS = 10 + 2 * MAX_HANDOFF_GROUPS

# dtype <-> code on the wire; codes never change meaning.
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_FULL = 0  # a full-attention group's window on the wire


class DrafterHandoff(ParsableEnum):
    """What a context worker sends for the drafter.

    ``WINDOW``: the drafter context the generation worker can still read (see the
    module docstring). ``NONE``: nothing; the generation worker seeds an empty
    context at the prompt end.
    """

    WINDOW = "window"
    NONE = "none"

    @classmethod
    def _kind(cls) -> str:
        return "drafter handoff"


class HandoffForm(ParsableEnum):
    """``KV``: the drafter's stored K/V (form a). ``HIDDEN``: the target hidden states it projects (form b)."""

    KV = "kv"
    HIDDEN = "hidden"

    @classmethod
    def _kind(cls) -> str:
        return "handoff form"


class DrafterContextMismatch(ValueError):
    """A received drafter context was made for another geometry; ``sent`` and ``expected`` are both kept."""

    def __init__(self, message: str, *, sent: "DrafterContextGeometry | None", expected: "DrafterContextGeometry") -> None:
        super().__init__(message)
        self.sent = sent
        self.expected = expected


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class DrafterContextGeometry:
    """What a drafter context on the wire is made of (tokens, pages, layers, bytes per value).

    ``windows[g]``: the drafter's attention window of draft layer group ``g``
    (tokens, ``None`` = full attention), not widened; ``trail_tokens``: what the
    draft pool keeps below every window (``T``, one page on a DFlash/DSpark pool
    under ``history`` sizing, else 0); ``layers[g]``: drafter layers of group
    ``g``; ``hidden_size``: values per position of form (b), 0 when the
    drafter's input width is unknown (form (b) then cannot be chosen).
    """

    tokens_per_block: int
    windows: tuple[int | None, ...]
    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    trail_tokens: int = 0
    form: HandoffForm = HandoffForm.KV
    hidden_size: int = 0
    hidden_dtype: torch.dtype | None = None  # None: the K/V dtype
    version: int = HANDOFF_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "windows", tuple(self.windows))
        object.__setattr__(self, "layers", tuple(int(n) for n in self.layers))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "form", HandoffForm.parse(self.form))
        if self.hidden_dtype is not None:
            object.__setattr__(self, "hidden_dtype", parse_dtype(self.hidden_dtype))
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if not self.windows or len(self.windows) != len(self.layers):
            raise ValueError(f"{len(self.windows)} windows for {len(self.layers)} draft layer groups (need >= 1 each)")
        if len(self.windows) > MAX_HANDOFF_GROUPS:
            raise ValueError(f"{len(self.windows)} draft layer groups; the wire carries at most {MAX_HANDOFF_GROUPS}")
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"windows must be >= 1 token or None (full attention), got {self.windows}")
        if min(self.layers) < 1 or self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(
                f"layers {self.layers}, num_kv_heads {self.num_kv_heads} and head_dim {self.head_dim} must be >= 1"
            )
        if self.trail_tokens < 0 or self.hidden_size < 0:
            raise ValueError(f"trail_tokens ({self.trail_tokens}) and hidden_size ({self.hidden_size}) must be >= 0")
        if self.form is HandoffForm.HIDDEN and self.hidden_size == 0:
            raise ValueError("form 'hidden' needs hidden_size (values per position of the drafter's input)")

    @classmethod
    def of_pool(
        cls,
        draft_manager: DraftPool,
        form: HandoffForm | str = HandoffForm.KV,
        hidden_size: int = 0,
        hidden_dtype: torch.dtype | None = None,
    ) -> "DrafterContextGeometry":
        """The geometry of a draft manager's pool (its config's groups, heads, dtype and its trail tokens)."""
        cfg = draft_manager.config
        return cls(
            tokens_per_block=cfg.tokens_per_block,
            windows=tuple(g.window for g in cfg.layer_groups),
            layers=tuple(g.num_layers for g in cfg.layer_groups),
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.dtype,
            trail_tokens=draft_manager.draft_slot_trail_tokens,
            form=form,
            hidden_size=hidden_size,
            hidden_dtype=hidden_dtype,
        )

    # ------------------------------------------------------------------ ranges
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def kept_tokens(self, group: int) -> int | None:
        """Tokens the draft pool keeps in ``group`` (its window widened by the trail), None = all."""
        w = self.windows[group]
        return None if w is None else w + self.trail_tokens

    def group_range(self, group: int, prompt_len: int) -> tuple[int, int]:
        """Absolute positions ``[lo, prompt_len)`` of ``group`` that are sent (see the module docstring)."""
        if prompt_len < 0:
            raise ValueError(f"a prompt cannot have {prompt_len} tokens")
        kept = self.kept_tokens(group)
        if kept is None:
            return 0, prompt_len
        return max(0, prompt_len + 1 - kept), prompt_len

    def ranges(self, prompt_len: int) -> list[tuple[int, int]]:
        """:meth:`group_range` of every group."""
        return [self.group_range(g, prompt_len) for g in range(self.num_groups)]

    def seed_start(self, prompt_len: int) -> int:
        """First absolute position the seeded slot holds: the highest group start, so every group holds it.

        A slot has one base for all groups; reading from the highest first page
        never touches a page some group did not receive.
        """
        return max(lo for lo, _ in self.ranges(prompt_len))

    def hidden_range(self, prompt_len: int) -> tuple[int, int]:
        """Positions of form (b): the union of the groups' ranges (one hidden state feeds every group)."""
        return min(lo for lo, _ in self.ranges(prompt_len)), prompt_len

    # ------------------------------------------------------------------ bytes
    @property
    def kv_bytes_per_token(self) -> tuple[int, ...]:
        """Bytes of K and V of one position, per group (every layer of the group)."""
        size = _dtype_size(self.dtype)
        return tuple(n * 2 * self.num_kv_heads * self.head_dim * size for n in self.layers)

    @property
    def hidden_bytes_per_token(self) -> int:
        return self.hidden_size * _dtype_size(self.hidden_dtype or self.dtype)

    def kv_bytes(self, prompt_len: int, *, whole_prompt: bool = False) -> int:
        """Bytes of form (a) for a prompt; ``whole_prompt``: as if every position ``[0, m)`` were sent."""
        total = 0
        for g, per_token in enumerate(self.kv_bytes_per_token):
            lo, hi = (0, prompt_len) if whole_prompt else self.group_range(g, prompt_len)
            total += (hi - lo) * per_token
        return total

    def hidden_bytes(self, prompt_len: int, *, whole_prompt: bool = False) -> int:
        """Bytes of form (b) for a prompt; ``whole_prompt``: every position ``[0, m)``."""
        lo, hi = (0, prompt_len) if whole_prompt else self.hidden_range(prompt_len)
        return (hi - lo) * self.hidden_bytes_per_token

    def payload_bytes(self, prompt_len: int, *, whole_prompt: bool = False) -> int:
        """Bytes of this geometry's own form."""
        if self.form is HandoffForm.HIDDEN:
            return self.hidden_bytes(prompt_len, whole_prompt=whole_prompt)
        return self.kv_bytes(prompt_len, whole_prompt=whole_prompt)

    # ------------------------------------------------------------------ compatibility
    def describe(self) -> str:
        """One line naming every field a receiver compares."""
        windows = ",".join("full" if w is None else str(w) for w in self.windows)
        hidden = f", hidden_size={self.hidden_size}" if self.form is HandoffForm.HIDDEN else ""
        return (
            f"v{self.version} form={self.form.value} page={self.tokens_per_block} windows=[{windows}] "
            f"trail={self.trail_tokens} layers={list(self.layers)} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} dtype={_dtype_name(self.dtype)}{hidden}"
        )

    def mismatches(self, other: "DrafterContextGeometry") -> list[str]:
        """Names of the fields where ``other`` differs (hidden fields only matter for form (b))."""
        names = ["version", "form", "tokens_per_block", "windows", "trail_tokens", "layers", "num_kv_heads",
                 "head_dim", "dtype"]
        if HandoffForm.HIDDEN in (self.form, other.form):
            names += ["hidden_size"]
        return [n for n in names if getattr(self, n) != getattr(other, n)]

    def check_compatible(self, sent: "DrafterContextGeometry", *, request_id: int | None = None) -> None:
        """Raise :class:`DrafterContextMismatch` unless a context made for ``sent`` can be written here.

        ``self`` is the receiver's own geometry. The message names the request,
        the differing fields and both geometries.
        """
        diff = self.mismatches(sent)
        if diff:
            who = "" if request_id is None else f"request {request_id}: "
            raise DrafterContextMismatch(
                f"{who}drafter context refused: it was made for another geometry (differs in {', '.join(diff)}); "
                f"sent: {sent.describe()}; this worker: {self.describe()}",
                sent=sent,
                expected=self,
            )

    # ------------------------------------------------------------------ wire
    def to_wire(self) -> list[int]:
        """The header as :data:`HEADER_INTS` integers, version first."""
        if self.dtype not in _DTYPE_CODES or (self.hidden_dtype or self.dtype) not in _DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype} / {self.hidden_dtype} has no wire code")
        out = [
            self.version,
            1 if self.form is HandoffForm.KV else 2,
            self.tokens_per_block,
            self.num_groups,
            self.num_kv_heads,
            self.head_dim,
            _DTYPE_CODES[self.dtype],
            self.trail_tokens,
            self.hidden_size,
            _DTYPE_CODES[self.hidden_dtype] if self.hidden_dtype is not None else 0,
        ]
        pad = MAX_HANDOFF_GROUPS - self.num_groups
        out += [_FULL if w is None else w for w in self.windows] + [-1] * pad
        out += list(self.layers) + [-1] * pad
        assert len(out) == HEADER_INTS
        return out

    @classmethod
    def from_wire(cls, ints: Sequence[int], *, expected: "DrafterContextGeometry | None" = None) -> "DrafterContextGeometry":
        """Decode :meth:`to_wire`. A header of another version or a malformed one raises
        :class:`DrafterContextMismatch` (when ``expected`` is given, naming it) or ``ValueError``."""
        ints = [int(x) for x in ints]
        if len(ints) != HEADER_INTS or ints[0] != HANDOFF_VERSION:
            what = f"version {ints[0]}" if ints else "an empty header"
            message = (
                f"drafter context header of {len(ints)} integers, {what}; this worker reads version "
                f"{HANDOFF_VERSION} headers of {HEADER_INTS} integers"
            )
            if expected is not None:
                raise DrafterContextMismatch(f"{message}; this worker: {expected.describe()}", sent=None, expected=expected)
            raise ValueError(message)
        version, form, page, groups, heads, dim, dtype, trail, hidden, hidden_dtype = ints[:10]
        if not 1 <= groups <= MAX_HANDOFF_GROUPS or form not in (1, 2) or dtype not in _CODE_DTYPES:
            raise ValueError(f"malformed drafter context header {ints}")
        windows = tuple(None if w == _FULL else w for w in ints[10 : 10 + groups])
        layers = tuple(ints[10 + MAX_HANDOFF_GROUPS : 10 + MAX_HANDOFF_GROUPS + groups])
        return cls(
            tokens_per_block=page,
            windows=windows,
            layers=layers,
            num_kv_heads=heads,
            head_dim=dim,
            dtype=_CODE_DTYPES[dtype],
            trail_tokens=trail,
            form=HandoffForm.KV if form == 1 else HandoffForm.HIDDEN,
            hidden_size=hidden,
            hidden_dtype=_CODE_DTYPES.get(hidden_dtype),
            version=version,
        )


@dataclasses.dataclass(frozen=True)
class HandoffBytes:
    """Bytes of one prompt's drafter context in both forms, sent and whole-prompt."""

    prompt_len: int
    kv: int  # form (a), the window only
    hidden: int  # form (b), the window only
    full_kv: int  # form (a) of every position [0, m)
    full_hidden: int  # form (b) of every position [0, m)

    @property
    def smaller_form(self) -> HandoffForm:
        """The form with fewer bytes (``kv`` on a tie: it needs no projection on the receiver)."""
        return HandoffForm.HIDDEN if self.hidden < self.kv else HandoffForm.KV


def handoff_bytes(geometry: DrafterContextGeometry, prompt_len: int) -> HandoffBytes:
    """Both forms' bytes for one prompt of ``prompt_len`` tokens (form (b) needs ``hidden_size``)."""
    return HandoffBytes(
        prompt_len,
        kv=geometry.kv_bytes(prompt_len),
        hidden=geometry.hidden_bytes(prompt_len),
        full_kv=geometry.kv_bytes(prompt_len, whole_prompt=True),
        full_hidden=geometry.hidden_bytes(prompt_len, whole_prompt=True),
    )


__all__ = [
    "DrafterContextGeometry",
    "DrafterContextMismatch",
    "DrafterHandoff",
    "HANDOFF_VERSION",
    "HEADER_INTS",
    "HandoffBytes",
    "HandoffForm",
    "MAX_HANDOFF_GROUPS",
    "handoff_bytes",
]
