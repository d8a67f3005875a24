"""The scenarios: tiny model dimensions, the runs to compare, and their config files.

A scenario is a geometry (`SimSetup`) and the runs that use it (`RunSpec`). It
reads from and writes to a JSON object holding the setup's fields and a `runs`
list (`Scenario.from_dict`, `Scenario.to_dict`, `load_scenario`). The embedded
default, `DEFAULT_SCENARIO`, is itself one such file shipped in the package:
`draftkv_sim/default_scenario.json`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from tensorrt_llm_draftkv.config import DEFAULT_DRAFTER, ParsableEnum, SpeculativeDecodingMode, tokens_per_block_problem, window_problem
from tensorrt_llm_draftkv.speculative.handoff import DrafterHandoff, HandoffForm

MODES = ("aggregated", "disaggregated")
SIZINGS = ("history", "legacy")
#: Block reuse (prefix caching, docs/block_reuse.md): `off`; `target`: the target pool reuses prefix pages
#: up to the draft window below the prompt end (`keep_drafter_window`), so the drafter computes every
#: position it reads; `target-all`: every cached page is reused and the drafter's context behind the hit
#: stays empty (the ablation that shows the acceptance collapse); `joint`: both pools reuse, the draft
#: mirror adopts the prefix pages holding the drafter's K/V (`joint_kv_cache_reuse` + `pair_joint_reuse`).
BLOCK_REUSE = ("off", "target", "target-all", "joint")
#: The drafters the simulator's toy DFlash-style drafter stands in for.
SIM_DRAFTERS = (SpeculativeDecodingMode.DFLASH, SpeculativeDecodingMode.DSPARK)
#: More requests than this in one run is a typo (`1x100000000`), not a workload.
MAX_PROMPTS_PER_RUN = 100_000
DEFAULT_SCENARIO_FILE = "default_scenario.json"


class ScenarioError(ValueError):
    """A scenario field that cannot be run; `field` names it (`chunk`, `runs[1].prompts`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def _int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(name, f"must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ScenarioError(name, f"must be >= {minimum}, got {value}")
    return value


def _window(value: Any, name: str) -> int | None:
    """A window in tokens; `None` or 0 is full attention."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    return _int(value, name)


def check_window(window: int | None, tokens_per_block: int, name: str) -> None:
    """The package's one window rule (`config.window_problem`): None is full attention, else >= one page."""
    if window is not None:
        _int(window, name)
    problem = window_problem(window, tokens_per_block, "tokens per block", "0 for full attention")
    if problem:
        raise ScenarioError(name, problem)


def parse_drafter(value: Any, name: str = "drafter") -> SpeculativeDecodingMode:
    """`dflash` or `dspark` (a mode or its name): the drafters the simulator models."""
    try:
        mode = SpeculativeDecodingMode.parse(value)
    except (TypeError, ValueError):
        mode = None
    if mode not in SIM_DRAFTERS:
        known = " or ".join(m.label for m in SIM_DRAFTERS)
        raise ScenarioError(name, f"the simulator models {known}, got {value!r}")
    return mode


def _parse_choice(enum: type[ParsableEnum], value: Any, name: str) -> Any:
    try:
        return enum.parse(value)
    except (TypeError, ValueError):
        known = " or ".join(m.value for m in enum)
        raise ScenarioError(name, f"must be {known}, got {value!r}") from None


def parse_handoff(value: Any, name: str = "drafter_handoff") -> DrafterHandoff:
    """`window` or `none`: what a disaggregated context worker sends for the drafter."""
    return _parse_choice(DrafterHandoff, value, name)


def parse_handoff_form(value: Any, name: str = "handoff_form") -> HandoffForm:
    """`kv` (the drafter's stored K/V) or `hidden` (the hidden states it projects)."""
    return _parse_choice(HandoffForm, value, name)


TRANSPORTS = ("auto", "nixl", "torch")


def parse_transport(value: Any, name: str = "transport") -> str:
    """`auto` (NIXL when it imports, else torch), `nixl` or `torch`: what moves a disaggregated run's pages."""
    if value not in TRANSPORTS:
        raise ScenarioError(name, f"must be auto, nixl or torch, got {value!r}")
    return value


def parse_block_reuse(value: Any, name: str = "block_reuse") -> str:
    """`off`, `target`, `target-all` or `joint` (see BLOCK_REUSE)."""
    if value not in BLOCK_REUSE:
        raise ScenarioError(name, f"must be {', '.join(BLOCK_REUSE[:-1])} or {BLOCK_REUSE[-1]}, got {value!r}")
    return value


def parse_prompt_list(text: str) -> tuple[int, ...]:
    """`131071,262144x4` -> five prompt lengths: comma-separated token counts, `NxK` for K copies of N.

    Raises ValueError naming the bad item.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected comma-separated prompt lengths such as '131071,262144x4', got {text!r}")
    prompts: list[int] = []
    for item in text.split(","):
        raw = item.strip()
        m = re.fullmatch(r"(\d+)(?:[xX](\d+))?", raw)
        if not m:
            what = "an empty item" if not raw else f"bad item {raw!r}"
            raise ValueError(
                f"{what} in {text!r}: each item is N (a prompt of N tokens) or NxK (K prompts of N tokens), "
                "e.g. 131071,262144x4"
            )
        length, copies = int(m.group(1)), int(m.group(2) or 1)
        if length < 1:
            raise ValueError(f"bad item {raw!r} in {text!r}: a prompt needs >= 1 token")
        if copies < 1:
            raise ValueError(f"bad item {raw!r} in {text!r}: the count after 'x' must be >= 1")
        if len(prompts) + copies > MAX_PROMPTS_PER_RUN:
            raise ValueError(f"bad item {raw!r} in {text!r}: more than {MAX_PROMPTS_PER_RUN} prompts in one run")
        prompts.extend([length] * copies)
    return tuple(prompts)


@dataclass(frozen=True)
class SimSetup:
    """Geometry of the tiny target, the drafter and both pools.

    Pools are sized by the estimator for `pool_requests` concurrent requests,
    exactly as a deployment would size them; nothing is padded for the demo.
    A window of `None` is full attention. `drafter_handoff`: what a
    disaggregated context worker sends for the drafter under `history` sizing
    (`window`, the default, or `none`; `legacy` never sends one), in
    `handoff_form` (`kv` or `hidden`). `block_reuse`: `off` (default),
    `target`, `target-all` or `joint` (see `BLOCK_REUSE`); reuse runs run under `history`
    sizing only. `transport`: the transfer engine between a disaggregated pair's
    workers, `nixl` (NIXL over UCX), `torch` (torch.distributed messages) or
    `auto` (the default: NIXL when it imports).
    """

    drafter: SpeculativeDecodingMode = DEFAULT_DRAFTER
    tokens_per_block: int = 32
    target_window: int | None = 4096
    draft_window: int | None = 4096
    chunk: int = 8192
    max_draft_len: int = 7
    vocab_size: int = 256
    target_dim: int = 32
    draft_kv_heads: int = 1
    draft_head_dim: int = 16
    pool_requests: int = 8
    max_new_tokens: int = 128
    drafter_slots: int = 8
    trail_page: bool = True
    device: str = "cpu"
    max_seq_len: int = 524288 + 1024
    drafter_handoff: DrafterHandoff = DrafterHandoff.WINDOW
    handoff_form: HandoffForm = HandoffForm.KV
    block_reuse: str = "off"
    transport: str = "auto"

    @property
    def block_size(self) -> int:
        return self.max_draft_len + 1

    @property
    def draft_extra_tokens(self) -> int:
        """The drafter appends its block above the accepted tokens in the same step."""
        return self.block_size

    # Smallest value of each integer field: the toy drafter needs two feature
    # channels besides its two rotary ones and a block of at least two tokens, and
    # the prompts are phrases of 24 distinct tokens from a bank of 6 (draftkv_sim/prompts.py).
    _MINIMUMS = {
        "tokens_per_block": 1,
        "chunk": 1,
        "max_draft_len": 1,
        "vocab_size": 6 * 24,
        "target_dim": 1,
        "draft_kv_heads": 1,
        "draft_head_dim": 4,
        "pool_requests": 1,
        "max_new_tokens": 1,
        "drafter_slots": 1,
        "max_seq_len": 1,
    }

    def check(self) -> None:
        """Raise ScenarioError naming the first field this simulator cannot run."""
        parse_drafter(self.drafter)
        if not isinstance(self.drafter_handoff, DrafterHandoff):
            raise ScenarioError("drafter_handoff", f"must be window or none, got {self.drafter_handoff!r}")
        if not isinstance(self.handoff_form, HandoffForm):
            raise ScenarioError("handoff_form", f"must be kv or hidden, got {self.handoff_form!r}")
        parse_block_reuse(self.block_reuse)
        parse_transport(self.transport)
        if self.transport == "nixl":
            from tensorrt_llm_draftkv.transfer import nixl_agent

            if (why := nixl_agent.nixl_unavailable()) is not None:
                raise ScenarioError("transport", f"nixl cannot run here: {why}")
        for name, minimum in self._MINIMUMS.items():
            _int(getattr(self, name), name, minimum)
        problem = tokens_per_block_problem(self.tokens_per_block)  # the package's one page rule
        if problem:
            raise ScenarioError("tokens_per_block", problem)
        for name in ("target_window", "draft_window"):
            check_window(getattr(self, name), self.tokens_per_block, name)
        if not isinstance(self.trail_page, bool):
            raise ScenarioError("trail_page", f"must be true or false, got {self.trail_page!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ScenarioError("device", f"must be a device name such as 'cpu' or 'cuda', got {self.device!r}")

    def to_dict(self) -> dict[str, Any]:
        """The config-file form: every field, the drafter by name, full attention as null."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["drafter"] = self.drafter.label
        out["drafter_handoff"] = self.drafter_handoff.value
        out["handoff_form"] = self.handoff_form.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: "SimSetup | None" = None) -> "SimSetup":
        """`base` (default: `SimSetup()`) with the fields of `data`; a window of 0 or null is full attention."""
        if not isinstance(data, dict):
            raise ScenarioError("", f"a setup is a JSON object of SimSetup fields, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        changes: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise ScenarioError(key, f"unknown field; known: {', '.join(known)}, runs")
            if key == "drafter":
                value = parse_drafter(value)
            elif key == "drafter_handoff":
                value = parse_handoff(value)
            elif key == "handoff_form":
                value = parse_handoff_form(value)
            elif key == "block_reuse":
                value = parse_block_reuse(value)
            elif key == "transport":
                value = parse_transport(value)
            elif key in ("target_window", "draft_window"):
                value = _window(value, key)
            changes[key] = value
        setup = replace(base or cls(), **changes)
        setup.check()
        return setup


@dataclass(frozen=True)
class RunSpec:
    """One run: prompts arriving in order, at most `max_concurrency` in flight."""

    name: str
    mode: str  # "aggregated" or "disaggregated"
    prompts: tuple[int, ...]
    max_concurrency: int
    drafter_slots: int | None = None  # overrides the setup's for this run
    draft_window: int | None = None  # overrides the setup's for this run (0: full attention)
    max_new_tokens: int | None = None  # overrides the setup's for this run
    note: str = ""  # what the run shows (the default scenario's file says it per run)
    # Keep one batch row for a waiting prompt (aggregated runs), so more requests generate than there
    # are drafter slots: the slot shortage a disaggregated generation worker sees.
    reserve_context_row: bool = False
    # The sizings this run is shown under (None: every sizing asked for); a run that only exists as
    # the aggregated twin of a disaggregated run, say, need not run under legacy.
    sizings: tuple[str, ...] | None = None
    # Tokens every prompt starts with (one common text, its own seed): prompt i is then the prefix followed
    # by a tail of `prompts[i]` tokens, `shared_prefix + prompts[i]` tokens in all. 0: no common prefix.
    shared_prefix: int = 0
    block_reuse: str | None = None  # overrides the setup's for this run (`off`, `target`, `joint`)

    @property
    def prompt_lengths(self) -> tuple[int, ...]:
        """Whole prompt lengths in tokens: the shared prefix plus each tail."""
        return tuple(self.shared_prefix + n for n in self.prompts)

    def prompt_keys(self) -> list[tuple[int, int, int]]:
        """`(shared prefix, tail seed, tail length)` per request: what identifies a prompt's text."""
        return [(self.shared_prefix, seed, n) for seed, n in zip(prompt_seeds(self.prompts), self.prompts)]

    def setup_for(self, setup: SimSetup) -> SimSetup:
        """The setup this run uses: the scenario's, with this run's overrides."""
        changes: dict[str, Any] = {}
        if self.block_reuse is not None:
            changes["block_reuse"] = self.block_reuse
        if self.draft_window is not None:
            changes["draft_window"] = self.draft_window or None
        if self.max_new_tokens is not None:
            changes["max_new_tokens"] = self.max_new_tokens
        if self.drafter_slots is not None:
            changes["drafter_slots"] = self.drafter_slots
        return replace(setup, **changes) if changes else setup

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"run {self.name}: mode must be 'aggregated' or 'disaggregated', got {self.mode!r}")
        if not self.prompts or min(self.prompts) < 1:
            raise ValueError(f"run {self.name}: prompts must be positive token counts, got {self.prompts}")
        if self.sizings is not None and (not self.sizings or set(self.sizings) - set(SIZINGS)):
            raise ValueError(f"run {self.name}: sizings must be a non-empty subset of {SIZINGS}, got {self.sizings}")
        if isinstance(self.shared_prefix, bool) or not isinstance(self.shared_prefix, int) or self.shared_prefix < 0:
            raise ValueError(f"run {self.name}: shared_prefix must be a token count >= 0, got {self.shared_prefix!r}")
        if self.block_reuse is not None and self.block_reuse not in BLOCK_REUSE:
            raise ValueError(f"run {self.name}: block_reuse must be one of {BLOCK_REUSE}, got {self.block_reuse!r}")

    def runs_under(self, sizing: str, setup: SimSetup | None = None) -> bool:
        """Is this run shown under `sizing` (`history` or `legacy`)? With block reuse on (in this run or in
        `setup`) only under `history`: the legacy rules predate block reuse."""
        reuse = self.block_reuse if self.block_reuse is not None else (setup.block_reuse if setup else "off")
        if reuse != "off" and sizing != "history":
            return False
        return self.sizings is None or sizing in self.sizings

    def to_dict(self) -> dict[str, Any]:
        """The config-file form; overrides left unset are left out."""
        out: dict[str, Any] = {
            "name": self.name,
            "mode": self.mode,
            "prompts": list(self.prompts),
            "max_concurrency": self.max_concurrency,
        }
        if self.shared_prefix:
            out["shared_prefix"] = self.shared_prefix
        for key in ("drafter_slots", "draft_window", "max_new_tokens", "block_reuse"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.reserve_context_row:
            out["reserve_context_row"] = True
        if self.sizings is not None:
            out["sizings"] = list(self.sizings)
        if self.note:
            out["note"] = self.note
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "run") -> "RunSpec":
        """A run from its config-file form; `prompts` is a list of lengths or a string like '131071,262144x4'."""
        if not isinstance(data, dict):
            raise ScenarioError(where, f"a run is a JSON object, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                raise ScenarioError(f"{where}.{key}", f"unknown field; known: {', '.join(known)}")
        for key in ("name", "mode", "prompts", "max_concurrency"):
            if key not in data:
                raise ScenarioError(f"{where}.{key}", "missing (a run needs name, mode, prompts, max_concurrency)")
        name = data["name"]
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ScenarioError(f"{where}.name", f"must be a non-empty name without surrounding spaces, got {name!r}")
        if data["mode"] not in MODES:
            raise ScenarioError(f"{where}.mode", f"must be 'aggregated' or 'disaggregated', got {data['mode']!r}")
        prompts = _run_prompts(data["prompts"], where)
        optional = _optional_run_fields(data, where)
        note = data.get("note", "")
        if not isinstance(note, str):
            raise ScenarioError(f"{where}.note", f"must be a string, got {note!r}")
        return cls(
            name,
            data["mode"],
            prompts,
            _int(data["max_concurrency"], f"{where}.max_concurrency"),
            note=note,
            **optional,
        )


def _run_prompts(raw: Any, where: str) -> tuple[int, ...]:
    """A run's `prompts` field: tail lengths in tokens, from a list or a string like '131071,262144x4'."""
    if isinstance(raw, str):
        try:
            return parse_prompt_list(raw)
        except ValueError as err:
            raise ScenarioError(f"{where}.prompts", str(err)) from None
    elif isinstance(raw, list) and raw:
        if len(raw) > MAX_PROMPTS_PER_RUN:
            raise ScenarioError(f"{where}.prompts", f"more than {MAX_PROMPTS_PER_RUN} prompts in one run")
        return tuple(_int(n, f"{where}.prompts[{i}]") for i, n in enumerate(raw))
    else:
        raise ScenarioError(
            f"{where}.prompts",
            f"must be a non-empty list of token counts or a string like '131071,262144x4', got {raw!r}",
        )


def _optional_run_fields(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A run's optional fields that are set, checked and converted, by field name (`note` aside)."""
    optional: dict[str, Any] = {}
    for key in ("drafter_slots", "max_new_tokens"):
        if data.get(key) is not None:
            optional[key] = _int(data[key], f"{where}.{key}")
    if data.get("draft_window") is not None:
        optional["draft_window"] = _int(data["draft_window"], f"{where}.draft_window", minimum=0)
    if data.get("shared_prefix") is not None:
        optional["shared_prefix"] = _int(data["shared_prefix"], f"{where}.shared_prefix", minimum=0)
    if data.get("block_reuse") is not None:
        optional["block_reuse"] = parse_block_reuse(data["block_reuse"], f"{where}.block_reuse")
    if "reserve_context_row" in data:
        if not isinstance(data["reserve_context_row"], bool):
            raise ScenarioError(f"{where}.reserve_context_row", f"must be true or false, got {data['reserve_context_row']!r}")
        optional["reserve_context_row"] = data["reserve_context_row"]
    if data.get("sizings") is not None:
        raw_sizings = data["sizings"]
        if not isinstance(raw_sizings, list) or not raw_sizings or any(x not in SIZINGS for x in raw_sizings):
            raise ScenarioError(f"{where}.sizings", f"must be a non-empty list of {SIZINGS}, got {raw_sizings!r}")
        optional["sizings"] = tuple(raw_sizings)
    return optional


@dataclass(frozen=True)
class Scenario:
    setup: SimSetup = field(default_factory=SimSetup)
    runs: tuple[RunSpec, ...] = ()

    def with_setup(self, **changes) -> "Scenario":
        return replace(self, setup=replace(self.setup, **changes))

    def check(self) -> None:
        """Raise ScenarioError naming the first field (of the setup or of a run) that cannot be run."""
        self.setup.check()
        seen: set[str] = set()
        for i, spec in enumerate(self.runs):
            where = f"runs[{i}]"
            if spec.name in seen:
                raise ScenarioError(f"{where}.name", f"run name {spec.name!r} is used twice")
            seen.add(spec.name)
            _int(spec.max_concurrency, f"{where}.max_concurrency")
            for key in ("drafter_slots", "max_new_tokens"):
                if getattr(spec, key) is not None:
                    _int(getattr(spec, key), f"{where}.{key}")
            if spec.draft_window is not None:
                _int(spec.draft_window, f"{where}.draft_window", minimum=0)
            setup = spec.setup_for(self.setup)
            check_window(setup.draft_window, setup.tokens_per_block, f"{where}.draft_window")
            if spec.shared_prefix and len(spec.prompts) < 2:
                raise ScenarioError(
                    f"{where}.shared_prefix",
                    f"run {spec.name!r} shares a {spec.shared_prefix}-token prefix among {len(spec.prompts)} "
                    "prompt; a shared prefix needs >= 2 prompts (the tails)",
                )
            if spec.block_reuse not in (None, "off") and spec.sizings is not None and "history" not in spec.sizings:
                raise ScenarioError(
                    f"{where}.sizings",
                    f"run {spec.name!r} has block_reuse {spec.block_reuse!r}, which runs under history sizing only; "
                    f"its sizings are {list(spec.sizings)}",
                )
            # A request's tokens, its last step's drafts and the drafter's block must fit
            # in the block table (max_seq_len tokens wide).
            longest = max(spec.prompt_lengths)
            need = longest + setup.max_new_tokens + setup.max_draft_len + setup.draft_extra_tokens
            if need > setup.max_seq_len:
                raise ScenarioError(
                    "max_seq_len",
                    f"{setup.max_seq_len} tokens cannot hold run {spec.name!r}: its longest prompt "
                    f"({longest}) + {setup.max_new_tokens} new tokens + {setup.max_draft_len} drafts "
                    f"+ {setup.draft_extra_tokens} drafter tokens = {need} (raise max_seq_len or shorten the run)",
                )

    def to_dict(self) -> dict[str, Any]:
        """The config-file form: the setup's fields and a `runs` list."""
        return {**self.setup.to_dict(), "runs": [spec.to_dict() for spec in self.runs]}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: SimSetup | None = None) -> "Scenario":
        """A scenario from its config-file form. Setup fields left out keep `base`'s (default: `SimSetup()`);
        without `runs` the scenario has none (the command line then needs `--prompts`)."""
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise ScenarioError("", f"a scenario is a JSON object (SimSetup fields and a runs list), got {kind}")
        setup = SimSetup.from_dict({k: v for k, v in data.items() if k != "runs"}, base=base)
        raw_runs = data.get("runs", [])
        if not isinstance(raw_runs, list):
            raise ScenarioError("runs", f"must be a list of runs, got {type(raw_runs).__name__}")
        runs = tuple(RunSpec.from_dict(r, f"runs[{i}]") for i, r in enumerate(raw_runs))
        scenario = cls(setup, runs)
        scenario.check()
        return scenario


def load_scenario(path: str | Path, *, base: SimSetup | None = None) -> Scenario:
    """A scenario from a JSON config file. Raises OSError (unreadable), ValueError (not JSON) or ScenarioError."""
    return Scenario.from_dict(json.loads(Path(path).read_text(encoding="utf-8")), base=base)


def default_scenario() -> Scenario:
    """The embedded scenario, read from the package's `default_scenario.json`."""
    text = resources.files(__package__).joinpath(DEFAULT_SCENARIO_FILE).read_text(encoding="utf-8")
    return Scenario.from_dict(json.loads(text))


DEFAULT_SCENARIO = default_scenario()


def prompt_seed(length: int, occurrence: int) -> int:
    """Prompts are identified by length and occurrence, so every run sees the same texts."""
    return 7919 * length + occurrence


def prompt_seeds(prompts: tuple[int, ...]) -> list[int]:
    seen: dict[int, int] = {}
    seeds = []
    for length in prompts:
        seeds.append(prompt_seed(length, seen.get(length, 0)))
        seen[length] = seen.get(length, 0) + 1
    return seeds
