"""`python -m tensorrt_llm_draftkv [simulate]`: a scenario, legacy vs history, as a table.

The scenario is the embedded default (`draftkv_draftkv_sim/default_scenario.json`), a config
file given with `--config`, or the runs built from `--prompts`; geometry flags
override the file. Every input (numbers, prompt list, config file, output
paths, device, run names) is checked before anything runs: a bad one is a
one-line `error: ...` on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # annotations only: the scenario module is imported where it is used
    from .scenario import Scenario, SimSetup

PROG = "python -m tensorrt_llm_draftkv simulate"

# Setup fields with a flag of their own (the flag's dest is the field's name).
GEOMETRY_FLAGS = {
    "drafter": "--drafter",
    "tokens_per_block": "--tokens-per-block",
    "draft_window": "--draft-window",
    "target_window": "--target-window",
    "chunk": "--chunk",
    "max_draft_len": "--max-draft-len",
    "pool_requests": "--pool-requests",
    "max_new_tokens": "--max-new-tokens",
    "drafter_slots": "--drafter-slots",
    "max_seq_len": "--max-seq-len",
    "device": "--device",
    "drafter_handoff": "--drafter-handoff",
    "handoff_form": "--handoff-form",
    "block_reuse": "--block-reuse",
    "transport": "--transport",
}
# Setup fields a run may override: a flag for one of them wins over the runs' own values.
RUN_OVERRIDES = ("draft_window", "max_new_tokens", "drafter_slots")
RUN_NAMES = {"aggregated": "user-agg", "disaggregated": "user-disagg"}


class UsageError(Exception):
    """A bad input, found before anything runs: `option` names it (or is empty)."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}" if option else message)


# -- argparse types: the value, or ArgumentTypeError("must be ..., got ...") ---------------------------------
def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


positive_int = _int_at_least(1)
window_tokens = _int_at_least(0)  # 0 = full attention; >= one page is checked with the page size (SimSetup.check)


def page_size(text: str) -> int:
    """--tokens-per-block (simulate and plan): the package's one page-size rule (`config.tokens_per_block_problem`)."""
    from tensorrt_llm_draftkv.config import tokens_per_block_problem

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    problem = tokens_per_block_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def prompt_list(text: str) -> tuple[int, ...]:
    from .scenario import parse_prompt_list

    try:
        return parse_prompt_list(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _scenario_type(parser_name: str):
    """An argparse ``type=`` running ``scenario.<parser_name>``; its ScenarioError becomes a usage error."""

    def convert(text: str):
        from . import scenario

        try:
            return getattr(scenario, parser_name)(text)
        except scenario.ScenarioError as err:
            raise argparse.ArgumentTypeError(err.message) from None

    convert.__name__ = parser_name
    return convert


drafter_mode = _scenario_type("parse_drafter")
handoff_mode = _scenario_type("parse_handoff")
handoff_form = _scenario_type("parse_handoff_form")
block_reuse_mode = _scenario_type("parse_block_reuse")
transport_name = _scenario_type("parse_transport")


def usage_fail(prog: str, message: str) -> NoReturn:
    """Every usage error (simulate, plan, bench): one line on stderr, exit status 2 (argparse's own status for usage errors)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


# -- options -----------------------------------------------------------------------------------------------
def add_simulate_args(p: argparse.ArgumentParser) -> None:
    from .scenario import DEFAULT_SCENARIO

    d = DEFAULT_SCENARIO.setup
    # Usage errors are one line (no usage block): argparse calls this parser's `error`.
    p.error = lambda message: usage_fail(p.prog, message)  # type: ignore[method-assign]
    p.set_defaults(_prog=p.prog)
    p.description = (
        "Run a scenario under the legacy and the history mirror sizing and print one row per run. Without "
        "--prompts or --config, the embedded default (draftkv_draftkv_sim/default_scenario.json; --print-config shows it)."
    )
    _add_run_args(p.add_argument_group("what to run"))
    _add_geometry_args(
        p.add_argument_group("geometry (default: the scenario's; a flag also wins over the runs' own values)"), d
    )
    _add_output_args(p.add_argument_group("output"))


def _add_run_args(w: argparse._ArgumentGroup) -> None:
    """The "what to run" options: sizings, modes, runs, prompts, a --config file."""
    w.add_argument(
        "--sizing",
        choices=("history", "legacy", "both"),
        default="both",
        help="mirror sizing and slot seeding to run: the fix (history), the pre-fix behaviour (legacy), or both "
        "side by side (default)",
    )
    w.add_argument(
        "--prompts",
        metavar="LIST",
        type=prompt_list,
        help="your own traffic instead of the scenario's runs: comma-separated prompt lengths in tokens, NxK for "
        "K copies of N (e.g. 131071,262144x4); runs named user-agg and/or user-disagg",
    )
    w.add_argument(
        "--shared-prefix",
        type=_int_at_least(0),
        metavar="N",
        help="with --prompts: every prompt starts with the same N-token text (its own seed) and the --prompts "
        "lengths are the tails after it (prompt i = prefix + tail i); default 0",
    )
    w.add_argument(
        "--mode",
        choices=("aggregated", "disaggregated", "both"),
        default="both",
        help="with --prompts: which runs to build; without: keep only the scenario's runs of this mode "
        "(default both)",
    )
    w.add_argument(
        "--concurrency",
        type=positive_int,
        metavar="N",
        help="requests in flight (default with --prompts: the number of prompts, at most --pool-requests; "
        "without: overrides every run's own)",
    )
    w.add_argument("--runs", nargs="*", metavar="NAME", help="names of the runs to execute (default: all)")
    w.add_argument(
        "--config",
        metavar="FILE.json",
        help="a scenario file: SimSetup fields and a 'runs' list (the format of --print-config); flags override it",
    )
    w.add_argument(
        "--print-config",
        action="store_true",
        help="print the scenario these options make, as a --config file, and exit without running it",
    )


def _add_geometry_args(g: argparse._ArgumentGroup, d) -> None:
    """The geometry options; `d` is the default scenario's setup (the defaults the help names)."""
    g.add_argument("--drafter", type=drafter_mode, metavar="{dflash,dspark}", help=f"drafter to model (default {d.drafter.label})")
    numbers = (  # flag, type, metavar, what, the field's default
        ("--tokens-per-block", page_size, "P", "page size, a power of two", d.tokens_per_block),
        ("--draft-window", window_tokens, "W", "draft attention window, >= one page; 0 = full attention",
         d.draft_window or 0),
        ("--target-window", window_tokens, "W", "target attention window, >= one page; 0 = full attention",
         d.target_window or 0),
        ("--chunk", positive_int, "N", "context chunk in tokens", d.chunk),
        ("--max-draft-len", positive_int, "N", "draft tokens per step", d.max_draft_len),
        ("--pool-requests", positive_int, "N", "concurrent requests both pools are sized for", d.pool_requests),
        ("--max-new-tokens", positive_int, "N", "tokens generated per request", d.max_new_tokens),
        ("--drafter-slots", positive_int, "N", "drafter slots", d.drafter_slots),
        ("--max-seq-len", positive_int, "N", "longest request in tokens", d.max_seq_len),
    )
    for flag, kind, metavar, what, default in numbers:
        g.add_argument(flag, type=kind, metavar=metavar, help=f"{what} (default {default})")
    g.add_argument(
        "--full-attention-target",
        action="store_true",
        help="give the target full-attention layers, as --target-window 0 (large target pool: meant for a GPU)",
    )
    g.add_argument(
        "--no-trail-page",
        action="store_true",
        help="turn the trail page off but keep the page-aligned seed (the ablation: shows what the page prevents)",
    )
    g.add_argument("--device", help=f"cpu, cuda or cuda:N (default {d.device})")
    g.add_argument(
        "--drafter-handoff",
        type=handoff_mode,
        metavar="{window,none}",
        help="what a disaggregated context worker sends for the drafter under history sizing: the drafter context "
        "the generation worker can still read (window) or nothing, an empty seed (none) "
        f"(default {d.drafter_handoff.value}; legacy sizing never sends one)",
    )
    g.add_argument(
        "--handoff-form",
        type=handoff_form,
        metavar="{kv,hidden}",
        help=f"the drafter context as the drafter's K/V (kv) or the hidden states it projects (hidden) "
        f"(default {d.handoff_form.value})",
    )
    g.add_argument(
        "--block-reuse",
        type=block_reuse_mode,
        metavar="{off,target,target-all,joint}",
        help="block reuse (prefix caching): off; in the target pool only, stopping short of the draft window so "
        "the drafter computes what it reads (target), or taking every cached page (target-all: the drafter's "
        "context behind the hit stays empty); or in both pools with the draft mirror adopting the prefix's "
        f"drafter K/V (joint); history sizing only. Over the scenario's runs it replaces the mode of the runs "
        f"that reuse and leaves their twins without reuse as they are (default {d.block_reuse})",
    )
    g.add_argument(
        "--transport",
        type=transport_name,
        metavar="{nixl,torch}",
        help="what moves a disaggregated run's pages between its two workers: NIXL over UCX (nixl, loopback on "
        "this host) or torch.distributed messages (torch); the JSON records which "
        f"(default {d.transport}: nixl when it imports, else torch)",
    )


def _add_output_args(o: argparse._ArgumentGroup) -> None:
    """The output options: --wide, --json, --plot, progress."""
    o.add_argument(
        "--wide",
        action="store_true",
        help="every column (tok/s, warmup too) and the events on each row's line (default: a table that fits "
        "120 columns, events below their row)",
    )
    o.add_argument("--json", metavar="FILE", help="write one record per row (its folder must exist)")
    o.add_argument("--plot", metavar="FILE.png", help="draw draft-pool occupancy over steps (needs matplotlib)")
    o.add_argument("--progress", action="store_true", help="show a progress bar on long runs (default: on a terminal)")
    o.add_argument("--quiet", action="store_true", help="no progress bar, even on a terminal (wins over --progress)")


# -- checks, all before anything runs -------------------------------------------------------------------------
def check_output_path(option: str, path: str) -> None:
    """The file can be written: its folder exists, is a folder, takes a new file; the path is not a folder."""
    if not path:
        raise UsageError(option, "needs a file name")
    target = Path(path)
    if target.is_dir():
        raise UsageError(option, f"{path} is a folder; give a file name")
    folder = target.parent
    if not folder.exists():
        raise UsageError(option, f"folder {folder} does not exist (for {path})")
    if not folder.is_dir():
        raise UsageError(option, f"{folder} is not a folder (for {path})")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(option, f"{path} exists and is not writable")
    try:  # the real test: permissions, read-only mounts, ACLs
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".draftkv-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UsageError(option, f"folder {folder} is not writable ({err.strerror or err})") from None


def check_plot(path: str) -> None:
    try:  # an optional extra: say so before the simulation, not after
        import matplotlib  # noqa: F401
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("", "--plot needs matplotlib (pip install -e '.[plot]')") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lower().lstrip(".") not in formats:
        others = ", ".join(f".{f}" for f in sorted(formats) if f != "png")
        raise UsageError("--plot", f"{path}: name an image file ending in .png (or {others})")


def check_device(name: str, option: str = "--device") -> None:
    """cpu, or a CUDA device this torch build and machine have. `option` names where the device came from."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(option, f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise UsageError(option, f"the simulator runs on cpu or cuda, got {name!r}")
    if not torch.backends.cuda.is_built():
        raise UsageError(option, f"{name}: this torch build ({torch.__version__}) has no CUDA; use --device cpu")
    if not torch.cuda.is_available():
        raise UsageError(option, f"{name}: torch has CUDA but no CUDA device is available; use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(option, f"{name}: there are {torch.cuda.device_count()} CUDA device(s)")


def _load_config(path: str):
    from .scenario import DEFAULT_SCENARIO, ScenarioError, load_scenario

    try:
        return load_scenario(path, base=DEFAULT_SCENARIO.setup)
    except OSError as err:
        raise UsageError("--config", f"cannot read {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} column {err.colno}"
        raise UsageError("--config", f"{path} is not valid JSON: {err.msg} ({where})") from None
    except UnicodeDecodeError as err:
        raise UsageError("--config", f"{path} is not UTF-8 text: {err.reason}") from None
    except ScenarioError as err:
        field = f"field {err.field}: " if err.field else ""
        raise UsageError("--config", f"{path}: {field}{err.message}") from None


def build_scenario(args: argparse.Namespace):
    """The scenario the options describe: the default or --config, the flags over it, the runs to execute."""
    from .scenario import DEFAULT_SCENARIO, Scenario

    scenario = _load_config(args.config) if args.config else DEFAULT_SCENARIO
    changes = _setup_changes(args)
    # --block-reuse over the scenario's runs replaces the mode of the runs that reuse, never the twin without
    # reuse they are compared with (see _reuse_flag); over --prompts runs it is the setup's.
    reuse_flag = None if args.prompts else changes.pop("block_reuse", None)
    setup = replace(scenario.setup, **changes)
    modes = ("aggregated", "disaggregated") if args.mode == "both" else (args.mode,)
    if args.shared_prefix and not args.prompts:
        raise UsageError("--shared-prefix", "needs --prompts (the tails after the prefix)")
    if args.prompts:
        runs = _prompt_runs(args, setup, modes)
    else:
        runs = _config_runs(args, scenario, changes, modes)
    if args.runs:
        runs = _named_runs(args, runs)
    if reuse_flag is not None:
        runs = _reuse_flag(setup, runs, reuse_flag)
    return _checked(args, Scenario(setup, runs))


def _setup_changes(args: argparse.Namespace) -> dict:
    """The setup fields the geometry flags change, by field name (windows in tokens, None = full attention)."""
    if args.full_attention_target and args.target_window:
        raise UsageError("--full-attention-target", f"contradicts --target-window {args.target_window}")
    changes = {field: getattr(args, field) for field in GEOMETRY_FLAGS if getattr(args, field) is not None}
    for field in ("draft_window", "target_window"):
        if changes.get(field) == 0:
            changes[field] = None  # 0 = full attention
    if args.full_attention_target:
        changes["target_window"] = None
    if args.no_trail_page:
        changes["trail_page"] = False
    return changes


def _prompt_runs(args: argparse.Namespace, setup: SimSetup, modes: tuple) -> tuple:
    """One run per mode over the --prompts lengths."""
    from .scenario import RunSpec

    concurrency = args.concurrency or min(len(args.prompts), setup.pool_requests)
    try:
        return tuple(
            RunSpec(RUN_NAMES[mode], mode, args.prompts, concurrency, shared_prefix=args.shared_prefix or 0)
            for mode in modes
        )
    except ValueError as err:
        raise UsageError("--shared-prefix", str(err)) from None


def _config_runs(args: argparse.Namespace, scenario: Scenario, changes: dict, modes: tuple) -> tuple:
    """The scenario's own runs, the flags' overrides applied, those of the --mode asked for."""
    if args.config and not scenario.runs:  # `{}` or `"runs": []`: never the built-in runs behind the user's back
        raise UsageError(
            "--config",
            f"{args.config} has no runs (its 'runs' list is missing or empty): add the runs to execute "
            "(--print-config shows the format) or give --prompts",
        )
    runs = scenario.runs
    overridden = {field: None for field in RUN_OVERRIDES if field in changes}
    if args.concurrency:
        overridden["max_concurrency"] = args.concurrency
    runs = tuple(replace(spec, **overridden) for spec in runs)
    if args.mode != "both":
        kept = tuple(spec for spec in runs if spec.mode in modes)
        if not kept:
            raise UsageError("--mode", f"no run is {args.mode}; runs: {', '.join(s.name for s in runs)}")
        runs = kept
    return runs


def _named_runs(args: argparse.Namespace, runs: tuple) -> tuple:
    """The runs --runs names, in its order, each once."""
    known = {spec.name: spec for spec in runs}
    missing = [name for name in args.runs if name not in known]
    if missing:
        of = "" if args.prompts or args.mode == "both" else f" (the {args.mode} ones)"
        raise UsageError("--runs", f"unknown run(s) {missing}; runs{of}: {sorted(known)}")
    return tuple(known[name] for name in dict.fromkeys(args.runs))


def _checked(args: argparse.Namespace, scenario: Scenario) -> Scenario:
    """``scenario`` once it checks; otherwise a usage error naming the option (or config file) at fault."""
    from .scenario import ScenarioError

    try:
        scenario.check()
    except ScenarioError as err:
        field = err.field.split(".")[-1]
        if err.field.startswith("runs[") and args.config and not args.prompts:  # a run of the file
            raise UsageError("--config", f"{args.config}: field {err.field}: {err.message}") from None
        if field in GEOMETRY_FLAGS:
            raise UsageError(GEOMETRY_FLAGS[field], err.message) from None
        if field == "shared_prefix" and args.prompts:
            raise UsageError("--shared-prefix", err.message) from None
        raise UsageError("", str(err)) from None
    return scenario


def _reuse_flag(setup, runs: tuple, mode: str) -> tuple:
    """`--block-reuse MODE` over a scenario's runs: every run that reuses (by its own value or the setup's)
    reuses in MODE; the runs without reuse stay without, so each reuse run keeps its twin to compare with
    (`--block-reuse target-all` gives the documented 2.800 / 6.000). When none of the runs reuses (runs
    chosen with --runs, say), MODE applies to all of them."""
    reusing = [spec for spec in runs if spec.setup_for(setup).block_reuse != "off"]
    chosen = {spec.name for spec in (reusing or runs)}
    return tuple(replace(spec, block_reuse=mode) if spec.name in chosen else spec for spec in runs)


def sizings_asked(args: argparse.Namespace) -> list[str]:
    """The sizings `--sizing` asks for, history first."""
    return ["history", "legacy"] if args.sizing == "both" else [args.sizing]


def check_something_runs(scenario, sizings: list[str]) -> None:
    """At least one (run, sizing) pair runs: else a usage error saying why each run is left out."""
    if any(spec.runs_under(sizing, scenario.setup) for spec in scenario.runs for sizing in sizings):
        return
    reasons = []
    for spec in scenario.runs:
        reuse = spec.setup_for(scenario.setup).block_reuse
        if reuse != "off":
            reasons.append(f"{spec.name} has block reuse {reuse}, which runs under history sizing only")
        else:
            reasons.append(f"{spec.name} runs under {' and '.join(spec.sizings or ())} sizing only")
    fix = "use --sizing history or both"
    if any("block reuse" in r for r in reasons):
        fix += ", or --block-reuse off"
    raise UsageError("--sizing", f"{' and '.join(sizings)} leaves nothing to run: {'; '.join(reasons)}; {fix}")


def scenario_notes(scenario) -> list[str]:
    """What a valid but overcommitted scenario will run into (said, not refused: it may be the experiment)."""
    notes = []
    for spec in scenario.runs:
        pool = spec.setup_for(scenario.setup).pool_requests
        in_flight = min(spec.max_concurrency, len(spec.prompts))  # a run never has more in flight than prompts
        if in_flight > pool:
            notes.append(
                f"note: run {spec.name} keeps {in_flight} requests in flight in pools sized for {pool} "
                "(--pool-requests): expect resize failures"
            )
    return notes


def check_inputs(args: argparse.Namespace):
    """Every check, cheapest first; returns the scenario to run. Raises UsageError."""
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            check_output_path(option, path)
    if args.json and args.plot and Path(args.json).resolve() == Path(args.plot).resolve():
        raise UsageError("--plot", f"{args.plot} is also the --json file")
    scenario = build_scenario(args)
    check_something_runs(scenario, sizings_asked(args))
    from_file = args.device is None and args.config is not None
    check_device(scenario.setup.device, f"--config ({args.config}: field device)" if from_file else "--device")
    if args.plot:
        check_plot(args.plot)
    return scenario


# -- the command ---------------------------------------------------------------------------------------------
def run_simulate(args: argparse.Namespace) -> int:
    prog = getattr(args, "_prog", PROG)
    try:
        scenario = check_inputs(args)
    except UsageError as err:
        usage_fail(prog, str(err))
    if args.print_config:
        print(json.dumps(scenario.to_dict(), indent=2))
        return 0
    for note in scenario_notes(scenario):
        print(note, file=sys.stderr)

    import torch

    # One intra-op thread per process (spawned ranks inherit the variable): on a
    # small host, two ranks with several threads each make timings swing 5-10x.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off in NCCL ranks (set here, not by the library)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from tensorrt_llm_draftkv.manager.rules import MirrorSizing
    from .plot import write_plot
    from .report import fit_lines, format_pairs, format_table, write_json
    from .simulate import simulate

    sizings = [MirrorSizing.HISTORY, MirrorSizing.LEGACY] if args.sizing == "both" else [MirrorSizing(args.sizing)]
    results = simulate(scenario, sizings, progress=(args.progress or sys.stderr.isatty()) and not args.quiet)
    print(format_table(results, wide=args.wide))
    pairs = format_pairs(results)
    if pairs:
        print(f"\n{pairs if args.wide else fit_lines(pairs)}")
    try:
        if args.json:
            write_json(results, args.json, scenario)
        if args.plot:
            write_plot(results, args.plot)
    except OSError as err:  # the folder went away during the run
        usage_fail(prog, f"cannot write {err.filename}: {err.strerror or err}")
    return 0
