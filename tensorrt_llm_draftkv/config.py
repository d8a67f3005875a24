"""Speculative-decoding modes and the geometry of a paged KV pool."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


# -- limits: the one rule every entry point applies (KVPoolConfig, `plan`, `simulate`, scenario files) ----------
#: TensorRT-LLM's page size is a power of two; larger than this is a typo, not a deployment.
MAX_TOKENS_PER_BLOCK = 1 << 12
#: Token counts (sequence lengths, windows, chunks) are 32-bit in TensorRT-LLM (SizeType32).
MAX_TOKENS = (1 << 31) - 1
#: Page indices in block tables are 32-bit: a pool of more pages cannot be addressed.
MAX_POOL_PAGES = (1 << 31) - 1


def tokens_per_block_problem(tokens_per_block) -> str | None:
    """Why `tokens_per_block` is not a page size (a power of two in [1, MAX_TOKENS_PER_BLOCK]), or None.

    The text is a phrase for after "<name>: ", e.g. "must be a power of two (1, 2, 4, ..., 4096), got 33".
    """
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        return f"must be an integer, got {tokens_per_block!r}"
    if tokens_per_block < 1:
        return f"must be >= 1, got {tokens_per_block}"
    if tokens_per_block > MAX_TOKENS_PER_BLOCK or tokens_per_block & (tokens_per_block - 1):
        return f"must be a power of two (1, 2, 4, ..., {MAX_TOKENS_PER_BLOCK}), got {tokens_per_block}"
    return None


def window_problem(
    window, tokens_per_block: int, page_name: str = "tokens_per_block", full: str = "None for full attention"
) -> str | None:
    """Why `window` is not an attention window over pages of `tokens_per_block` tokens, or None.

    `None` (full attention) is always fine; a window is at least one page (a shorter one would release
    the page it is reading) and at most MAX_TOKENS. `page_name` names the page size and `full` says how
    to ask for full attention, as the caller's user spells them (`--tokens-per-block`, `0 for full
    attention` on a command line). The text is a phrase for after "<name>: ".
    """
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        return f"must be an integer number of tokens, got {window!r}"
    if window > MAX_TOKENS:
        return f"must be <= {MAX_TOKENS} tokens, got {window}"
    if window < tokens_per_block:
        return (
            f"a window of {window} tokens is shorter than one page ({page_name} {tokens_per_block}); give a "
            f"window of at least {tokens_per_block} tokens or {full}"
        )
    return None


def check_pool_geometry(tokens_per_block: int, windows, where: str = "") -> None:
    """ValueError unless the page size and every window pass the rules above (`where` prefixes the message)."""
    lead = f"{where}: " if where else ""
    problem = tokens_per_block_problem(tokens_per_block)
    if problem:
        raise ValueError(f"{lead}tokens_per_block {problem}")
    for i, window in enumerate(windows):
        problem = window_problem(window, tokens_per_block)
        if problem:
            raise ValueError(f"{lead}layer group {i}: {problem}")


class ParsableEnum(enum.Enum):
    """An enum that also accepts its members' values or names as strings (any case, '-' for '_')."""

    @classmethod
    def parse(cls, text):
        """A member from itself, its value or its name; ValueError listing the known values otherwise."""
        if isinstance(text, cls):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a {cls._kind()} is a {cls.__name__} or a string, got {type(text).__name__}")
        key = text.strip().lower().replace("-", "_")
        for member in cls:
            if member.value == key or member.name.lower() == key:
                return member
        values = [m.value for m in cls]
        hint = f" (use {' or '.join(repr(v) for v in values)})" if len(values) <= 3 else ""
        raise ValueError(f"unknown {cls._kind()} {text!r}; known: {', '.join(values)}{hint}")

    @classmethod
    def _kind(cls) -> str:
        """What error messages call a member ("speculative decoding mode", ...)."""
        return cls.__name__


class SpeculativeDecodingMode(enum.IntEnum):
    """Which drafter runs beside the target: upstream TensorRT-LLM's IntEnum, its members in its
    order (so the integers match) and its predicates, plus `keeps_trail_page` and `parse`."""

    MTP = enum.auto()
    MTP_EAGLE = enum.auto()
    MTP_EAGLE_ONE_MODEL = enum.auto()
    EAGLE3 = enum.auto()
    EAGLE3_ONE_MODEL = enum.auto()
    NGRAM = enum.auto()
    SA = enum.auto()
    DRAFT_TARGET = enum.auto()
    DRAFT_TARGET_ONE_MODEL = enum.auto()
    USER_PROVIDED = enum.auto()
    SAVE_HIDDEN_STATES = enum.auto()
    PARD = enum.auto()
    DFLASH = enum.auto()
    DSPARK = enum.auto()
    NONE = enum.auto()
    AUTO = enum.auto()

    # -- one member each ----------------------------------------------------------------------
    def is_mtp_vanilla(self) -> bool:
        return self is SpeculativeDecodingMode.MTP

    def is_mtp_eagle(self) -> bool:
        return self is SpeculativeDecodingMode.MTP_EAGLE

    def is_mtp_eagle_one_model(self) -> bool:
        return self is SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL

    def is_eagle3(self) -> bool:
        return self is SpeculativeDecodingMode.EAGLE3

    def is_eagle3_one_model(self) -> bool:
        return self is SpeculativeDecodingMode.EAGLE3_ONE_MODEL

    def is_ngram(self) -> bool:
        return self is SpeculativeDecodingMode.NGRAM

    def is_sa(self) -> bool:
        return self is SpeculativeDecodingMode.SA

    def is_draft_target(self) -> bool:
        return self is SpeculativeDecodingMode.DRAFT_TARGET

    def is_draft_target_one_model(self) -> bool:
        return self is SpeculativeDecodingMode.DRAFT_TARGET_ONE_MODEL

    def is_user_provided(self) -> bool:
        return self is SpeculativeDecodingMode.USER_PROVIDED

    def is_save_hidden_states(self) -> bool:
        return self is SpeculativeDecodingMode.SAVE_HIDDEN_STATES

    def is_pard(self) -> bool:
        return self is SpeculativeDecodingMode.PARD

    def is_dflash(self) -> bool:
        return self is SpeculativeDecodingMode.DFLASH

    def is_dspark(self) -> bool:
        return self is SpeculativeDecodingMode.DSPARK

    def is_none(self) -> bool:
        return self is SpeculativeDecodingMode.NONE

    # -- families -----------------------------------------------------------------------------
    def is_mtp_one_model(self) -> bool:
        """Vanilla MTP or MTP-Eagle one-model (both run inside the target's engine)."""
        return self in (SpeculativeDecodingMode.MTP, SpeculativeDecodingMode.MTP_EAGLE_ONE_MODEL)

    def is_parallel_draft(self) -> bool:
        """Drafters that propose a whole block in one pass: PARD, DFlash, DSpark."""
        return self.is_pard() or self.is_dflash() or self.is_dspark()

    def is_external_drafter(self) -> bool:
        """A separate draft network run inside the target's engine, with its own mirror:
        PARD, DFlash, DSpark and draft-target one-model."""
        return self.is_parallel_draft() or self.is_draft_target_one_model()

    def use_one_engine(self) -> bool:
        """The drafter runs in the target's engine (nothing else advances the draft view)."""
        return self.is_eagle3_one_model() or self.is_mtp_one_model() or self.is_external_drafter() or self.is_sa()

    def has_draft_model(self) -> bool:
        return self.is_eagle3() or self.is_draft_target() or self.is_mtp_eagle()

    def has_spec_decoder(self) -> bool:
        return (self.is_mtp_one_model() or self.is_mtp_eagle() or self.is_eagle3() or self.is_eagle3_one_model()
                or self.is_external_drafter() or self.is_sa())

    def has_spec_drafter(self) -> bool:
        return self.is_eagle3() or self.is_draft_target() or self.is_ngram() or self.is_user_provided() or self.is_mtp_eagle()

    def without_logits(self) -> bool:
        return self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_external_drafter() or self.is_sa()

    def needs_kv_cache_rewind(self) -> bool:
        return (self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_ngram() or self.is_sa()
                or self.is_external_drafter())

    def needs_kv_cache_recompute(self) -> bool:
        """The drafter's first forward recomputes K/V for the accepted tokens (Eagle3, MTP-Eagle)."""
        return self.is_eagle3() or self.is_mtp_eagle()

    def need_load_draft_weights(self) -> bool:
        return self.is_eagle3_one_model() or self.is_external_drafter()

    def support_overlap_scheduler(self) -> bool:
        return (self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_sa() or self.has_draft_model()
                or self.is_external_drafter())

    def support_guided_decoder(self) -> bool:
        return self.is_none() or self.has_spec_drafter()

    def support_capturable_guided_decoder(self) -> bool:
        return self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_external_drafter() or self.is_sa()

    def support_dynamic_draft_len(self) -> bool:
        return (self.is_mtp_one_model() or self.is_eagle3_one_model() or self.is_mtp_eagle_one_model()
                or self.is_pard() or self.is_dflash() or self.is_draft_target_one_model() or self.is_sa())

    # -- ours -----------------------------------------------------------------------------------
    def keeps_trail_page(self) -> bool:
        """DFlash-style drafters seed slots on a page boundary and so trail by < P tokens."""
        return self in (SpeculativeDecodingMode.DFLASH, SpeculativeDecodingMode.DSPARK)

    @property
    def label(self) -> str:
        """The lower-case name ("dflash"), as command lines, scenario files and reports spell it."""
        return self.name.lower()

    @staticmethod
    def from_string(name: str | None) -> "SpeculativeDecodingMode":
        """Upstream's lookup: None is NONE, else the member of that name (any case); KeyError otherwise."""
        if name is None:
            return SpeculativeDecodingMode.NONE
        return SpeculativeDecodingMode[name.upper()]

    @classmethod
    def parse(cls, text: "SpeculativeDecodingMode | str") -> "SpeculativeDecodingMode":
        """A member from itself or its name (any case, '-' for '_'); ValueError listing the names otherwise.

        Unlike `from_string`, a bad name is a ValueError that lists every member (for command
        lines and config files), and an integer is refused (a mode is named, not numbered).
        """
        if isinstance(text, cls):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a speculative decoding mode is a SpeculativeDecodingMode or a string, got {type(text).__name__}")
        key = text.strip().upper().replace("-", "_")
        if key in cls.__members__:
            return cls[key]
        known = ", ".join(m.label for m in cls)
        raise ValueError(f"unknown speculative decoding mode {text!r}; known: {known}")


#: The drafter the command line assumes unless told (`plan --drafter`, `simulate --drafter`, SimSetup).
DEFAULT_DRAFTER = SpeculativeDecodingMode.DFLASH


@dataclass(frozen=True)
class LayerGroupConfig:
    """Layers that share one life cycle, and therefore one page pool.

    `window` is the attention window in tokens (None = full attention);
    `sink_blocks` leading blocks are never released by the window.
    """

    num_layers: int
    window: int | None = None
    sink_blocks: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"a layer group needs at least one layer, got num_layers={self.num_layers}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window must be >= 1 token, got window={self.window}")
        if self.sink_blocks < 0:
            raise ValueError(f"sink_blocks must be >= 0, got {self.sink_blocks}")


_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a torch dtype or one of the names in `_DTYPES` (any case)."""
    if isinstance(name, torch.dtype):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a dtype is a torch.dtype or a string, got {type(name).__name__}")
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(_DTYPES))}") from None


@dataclass(frozen=True)
class KVPoolConfig:
    """Geometry of one manager's pools: one pool per layer group.

    `pages_per_group[i]` is the number of pages (each `tokens_per_block` tokens of
    every layer in group i) that pool i holds; `guard_page` adds one reserved page
    per pool that unbacked block-table entries resolve to in the "cpp" export.
    `dtype` is a torch dtype or its name ("bf16", "float16", ...: see `parse_dtype`).
    `enable_block_reuse`: full pages are published by their token ids and shared by
    later requests with the same prefix (docs/block_reuse.md); a draft pool takes
    part only with `joint_kv_cache_reuse`.

    Not TensorRT-LLM's user-facing `KvCacheConfig` (memory fraction, max tokens,
    block reuse; `tensorrt_llm_draftkv.llmapi.KvCacheConfig`): this is only the pools'
    geometry, what `KVCacheManagerV2.from_pool_config` builds from.
    """

    layer_groups: tuple[LayerGroupConfig, ...]
    pages_per_group: tuple[int, ...]
    tokens_per_block: int = 32
    num_kv_heads: int = 1
    head_dim: int = 8
    dtype: torch.dtype = torch.float32
    kv_factor: int = 2
    device: str = "cpu"
    guard_page: bool = False
    max_seq_len: int = 1 << 20
    enable_block_reuse: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if len(self.layer_groups) == 0:
            raise ValueError("a KV cache needs at least one layer group")
        if len(self.pages_per_group) != len(self.layer_groups):
            raise ValueError(
                f"pages_per_group has {len(self.pages_per_group)} entries for "
                f"{len(self.layer_groups)} layer groups"
            )
        for i, pages in enumerate(self.pages_per_group):
            if pages < 0:
                raise ValueError(f"layer group {i}: pool size must be >= 0 pages, got {pages}")
        for name in ("num_kv_heads", "head_dim", "kv_factor", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def check_geometry(self) -> "KVPoolConfig":
        """The deployment rule (`check_pool_geometry`): a power-of-two page, every window at least one page.

        Not applied on construction: the runtime itself handles any page size and window, and its property
        tests build such pools; every entry point a user reaches (`plan`, `simulate`, scenario files,
        `PoolReport.to_pool_config`) applies it. Returns the config; ValueError naming the numbers otherwise.
        """
        check_pool_geometry(self.tokens_per_block, self.windows, "KVPoolConfig")
        return self

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.layer_groups)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)
