"""`python -m tensorrt_llm_draftkv plan`: pages, bytes and concurrency for a pool geometry and budget.

Every option is checked by its argparse type (a bad value is a usage error, exit
2, naming the option); options that only make sense together are checked right
after parsing, before anything is computed. A pool that cannot hold one request
is reported on stderr with both numbers (exit 1). The target pool is planned only
when target layers are given.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from tensorrt_llm_draftkv.config import (
    DEFAULT_DRAFTER,
    MAX_POOL_PAGES,
    MAX_TOKENS,
    LayerGroupConfig,
    SpeculativeDecodingMode,
    parse_dtype,
    window_problem,
)
from .cli_simulate import UsageError, check_output_path, page_size, usage_fail
from tensorrt_llm_draftkv.manager.plan_format import format_bytes, format_report, format_savings
from tensorrt_llm_draftkv.manager.planner import GIB, PoolGeometry, PoolReport, gib_to_bytes, plan_pool, trail_tokens_for
from tensorrt_llm_draftkv.manager.reuse_savings import prefix_reuse_savings

if TYPE_CHECKING:  # annotations only: plan itself never needs torch loaded here
    import torch

PROG = "python -m tensorrt_llm_draftkv plan"


#: Bounds of what a deployment can mean (past them a value is a typo, and the tables lose their columns).
MAX_LAYERS = 10_000
MAX_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 16
MAX_DRAFT_LEN = 1 << 10
MAX_TP = 1 << 16
MAX_GIB = 1 << 20  # 1 PiB per rank


# -- argparse types: each returns the value or raises ArgumentTypeError("must be ..., got ...") --------------
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _int_in(low: int, high: int):
    def check(text: str) -> int:
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value

    check.__name__ = f"int in [{low}, {high}]"
    return check


def _int_at_least(low: int):
    return _int_in(low, MAX_TOKENS)


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)
layers = _int_in(0, MAX_LAYERS)
heads = _int_in(1, MAX_HEADS)
head_dim = _int_in(1, MAX_HEAD_DIM)
draft_len = _int_in(0, MAX_DRAFT_LEN)
tp_ranks = _int_in(1, MAX_TP)


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def gib(text: str) -> float:
    """A budget in GiB: > 0 and at most MAX_GIB (1 PiB)."""
    value = positive_float(text)
    if value > MAX_GIB:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_GIB} GiB (1 PiB), got {text}")
    return value


def fraction(text: str) -> float:
    value = _finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def dtype_name(text: str) -> str:
    try:
        parse_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text.lower()


def _mode(text: str) -> SpeculativeDecodingMode:
    try:
        return SpeculativeDecodingMode.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class _Given(argparse._StoreAction):
    """`store`, also noting the option as given (`args._given`): a default and the same value typed differ."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace._given = set(getattr(namespace, "_given", ())) | {self.dest}


#: Options of the target pool: each needs target layers.
TARGET_OPTIONS = {
    "target_window": "--target-window",
    "target_num_kv_heads": "--target-num-kv-heads",
    "target_head_dim": "--target-head-dim",
    "target_num_extra_kv_tokens": "--target-num-extra-kv-tokens",
    "target_pool_gib": "--target-pool-gib",
    "target_max_tokens": "--target-max-tokens",
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except where there is none (an option that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


# -- options -----------------------------------------------------------------------------------------------
def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = _HelpFormatter
    p.register("action", None, _Given)  # every plain option notes that it was given
    p.error = lambda message: usage_fail(p.prog, message)  # type: ignore[method-assign]  one line, no usage
    p.description = (
        "Pages, bytes and concurrency of a draft KV pool (and of a target pool when target layers are given) "
        "for a geometry and a budget. Byte budgets are per rank (one GPU)."
    )
    p.set_defaults(_plan_parser=p)
    # the help lists options in the order they are added: draft geometry, its budget, then the target
    _add_draft_args(p)
    _add_draft_budget_args(p)
    _add_target_args(p)


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    """The draft pool's geometry and sizing options, and the output options (ungrouped in the help)."""
    p.add_argument(
        "--drafter", default=DEFAULT_DRAFTER.label, type=_mode, help="speculative mode (dflash, dspark, pard, mtp, ...)"
    )
    p.add_argument("--num-layers", type=layers, default=5, help="windowed draft layers")
    p.add_argument("--num-full-layers", type=layers, default=0, help="full-attention draft layers")
    p.add_argument("--num-kv-heads", type=heads, default=4, help="draft KV heads (all ranks)")
    p.add_argument("--head-dim", type=head_dim, default=128, help="draft head size")
    p.add_argument("--dtype", type=dtype_name, default="bfloat16", help="KV dtype (bf16, fp16, fp32, fp8, ...)")
    p.add_argument("--tokens-per-block", type=page_size, default=32, help="page size P in tokens (a power of two)")
    p.add_argument(
        "--window", type=non_negative_int, default=4096,
        help="attention window of the windowed draft layers in tokens (0 = full attention; else >= one page)",
    )
    p.add_argument(
        "--max-seq-len", type=positive_int, default=524288,
        help="longest request in tokens (what a full-attention group is charged)",
    )
    p.add_argument("--chunk", type=positive_int, default=8192, help="context chunk size in tokens")
    p.add_argument("--max-draft-len", type=draft_len, default=7, help="draft tokens per step")
    p.add_argument(
        "--num-extra-kv-tokens", type=non_negative_int, default=0,
        help="extra KV tokens every step puts above history in the draft pool",
    )
    p.add_argument(
        "--tp", type=tp_ranks, default=1,
        help="tensor-parallel ranks: KV heads are sharded over them (ceil(heads / tp) per rank)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the whole report as JSON to FILE")
    p.add_argument(
        "--shared-prefix", type=non_negative_int, default=0, metavar="N",
        help="also print what block reuse saves per request sharing an N-token prefix (pages, bytes, per pool)",
    )


def _add_draft_budget_args(p: argparse.ArgumentParser) -> None:
    """The draft pool budget group: bytes, token slots or a fraction of the device (one at a time)."""
    b = p.add_argument_group("draft pool budget (one of --pool-gib, --max-tokens, --memory-fraction)")
    forms = b.add_mutually_exclusive_group()
    forms.add_argument(
        "--pool-gib", type=gib, default=1.0,
        help="bytes one rank gives the draft pool, in GiB (used unless another form is given)",
    )
    forms.add_argument(
        "--max-tokens", type=positive_int, default=None,
        help="token slots every draft layer group holds (rounded up to pages), as TensorRT-LLM's max_tokens",
    )
    forms.add_argument(
        "--memory-fraction", type=fraction, default=None,
        help="fraction of --device-memory-gib given to the draft pool (as free_gpu_memory_fraction / "
        "gpu_memory_utilization)",
    )
    b.add_argument(
        "--device-memory-gib", type=gib, default=None,
        help="memory of one device in GiB (with --memory-fraction only)",
    )


def _add_target_args(p: argparse.ArgumentParser) -> None:
    """The target pool group: its geometry and its budget (bytes or token slots)."""
    t = p.add_argument_group("target pool (planned only when target layers are given)")
    t.add_argument("--target-num-layers", type=layers, default=0, help="windowed target layers")
    t.add_argument("--target-num-full-layers", type=layers, default=0, help="full-attention target layers")
    t.add_argument("--target-num-kv-heads", type=heads, default=8, help="target KV heads (all ranks)")
    t.add_argument("--target-head-dim", type=head_dim, default=128, help="target head size")
    t.add_argument(
        "--target-window", type=non_negative_int, default=4096,
        help="target attention window (0 = full; else >= one page)",
    )
    t.add_argument(
        "--target-num-extra-kv-tokens", type=non_negative_int, default=0,
        help="extra KV tokens every step puts above history in the target pool",
    )
    tb = t.add_mutually_exclusive_group()
    tb.add_argument(
        "--target-pool-gib", type=gib, default=64.0,
        help="bytes one rank gives the target pool, in GiB (used unless --target-max-tokens is given)",
    )
    tb.add_argument(
        "--target-max-tokens", type=positive_int, default=None,
        help="token slots every target layer group holds (rounded up to pages)",
    )


# -- cross-option checks -------------------------------------------------------------------------------------
def _parser(args: argparse.Namespace) -> argparse.ArgumentParser:
    parser = getattr(args, "_plan_parser", None)
    if parser is None:  # a Namespace built without add_plan_args' parser
        parser = argparse.ArgumentParser(prog=PROG)
        add_plan_args(parser)
    return parser


def _check_window(parser: argparse.ArgumentParser, option: str, window: int, tokens_per_block: int) -> None:
    problem = window_problem(window or None, tokens_per_block, "--tokens-per-block", "0 for full attention")
    if problem:
        parser.error(f"argument {option}: {problem}")


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    given = getattr(args, "_given", set())
    if args.num_layers == 0 and args.num_full_layers == 0:
        parser.error("argument --num-layers: --num-layers and --num-full-layers are both 0: the draft pool has no layers")
    if args.num_layers:
        _check_window(parser, "--window", args.window, args.tokens_per_block)
    elif "window" in given:
        parser.error(
            f"argument --window: --window {args.window} applies to windowed draft layers, and --num-layers is 0"
        )
    if not args.target_num_layers and not args.target_num_full_layers:
        for dest, option in TARGET_OPTIONS.items():
            if dest in given:
                parser.error(
                    f"argument {option}: the target pool is planned only with target layers; give "
                    "--target-num-layers or --target-num-full-layers, or drop " + option
                )
    if args.target_num_layers:
        _check_window(parser, "--target-window", args.target_window, args.tokens_per_block)
    elif "target_window" in given:
        parser.error(
            f"argument --target-window: --target-window {args.target_window} applies to windowed target layers, "
            "and --target-num-layers is 0"
        )
    if args.memory_fraction is not None and args.device_memory_gib is None:
        parser.error("argument --memory-fraction: needs --device-memory-gib (the memory of one device)")
    if args.device_memory_gib is not None and args.memory_fraction is None:
        parser.error("argument --device-memory-gib: only with --memory-fraction")
    if args.json is not None:
        try:
            check_output_path("--json", args.json)  # simulate's and bench's rule: writable before anything runs
        except UsageError as err:
            parser.error(str(err))


# -- the plan ------------------------------------------------------------------------------------------------
def _groups(windowed: int, window: int, full: int) -> tuple[LayerGroupConfig, ...]:
    groups = []
    if windowed:
        groups.append(LayerGroupConfig(windowed, window=window or None))
    if full:
        groups.append(LayerGroupConfig(full, window=None))
    return tuple(groups)


def _draft_budget(args: argparse.Namespace) -> tuple[dict, dict]:
    """(plan_pool's budget keyword, the budget as the JSON and the text show it)."""
    if args.max_tokens is not None:
        return {"max_tokens": args.max_tokens}, {"form": "max_tokens", "max_tokens": args.max_tokens}
    if args.memory_fraction is not None:
        budget = math.floor(Fraction(args.memory_fraction) * Fraction(args.device_memory_gib) * (1 << 30))
        return {"budget_bytes": budget}, {
            "form": "memory_fraction",
            "memory_fraction": args.memory_fraction,
            "device_memory_gib": args.device_memory_gib,
            "budget_bytes_per_rank": budget,
        }
    budget = gib_to_bytes(args.pool_gib)
    return {"budget_bytes": budget}, {"form": "pool_gib", "pool_gib": args.pool_gib, "budget_bytes_per_rank": budget}


def _target_budget(args: argparse.Namespace) -> tuple[dict, dict]:
    if args.target_max_tokens is not None:
        return {"max_tokens": args.target_max_tokens}, {"form": "max_tokens", "max_tokens": args.target_max_tokens}
    budget = gib_to_bytes(args.target_pool_gib)
    return {"budget_bytes": budget}, {"form": "pool_gib", "pool_gib": args.target_pool_gib, "budget_bytes_per_rank": budget}


def _budget_line(budget: dict, report: PoolReport) -> str:
    pages = [g.pool_pages for g in report.groups]
    pages_text = f"{pages[0]} pool pages" if len(pages) == 1 else f"pool pages {pages} (per group)"
    if budget["form"] == "max_tokens":
        what = f"{budget['max_tokens']} token slots per group (--max-tokens)"
    elif budget["form"] == "memory_fraction":
        what = (
            f"{budget['memory_fraction']} of {budget['device_memory_gib']} GiB = "
            f"{format_bytes(budget['budget_bytes_per_rank'])} per rank"
        )
    else:
        what = f"{format_bytes(budget['budget_bytes_per_rank'])} per rank"
    return f"  budget: {what}: {pages_text}, {format_bytes(report.pool_bytes_per_rank)} per rank used"


def _budget_option(budget: dict, target: bool) -> str:
    """The option that set this budget (what a user changes when it buys too few or too many pages)."""
    option = {"pool_gib": "--pool-gib", "max_tokens": "--max-tokens", "memory_fraction": "--memory-fraction"}
    return ("--target-" + option[budget["form"]][2:]) if target else option[budget["form"]]


def _ceil_to(value: float, digits: int = 4) -> str:
    """`value` rounded up to `digits` significant digits, as text (a budget that surely suffices)."""
    if value <= 0:
        return "0"
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return f"{math.ceil(value * scale) / scale:.{digits}g}"


def _least_budget(report: PoolReport, budget: dict, option: str) -> str:
    """`give at least OPTION X`: the smallest budget of this form that holds one request."""
    need_bytes = report.bytes_per_request_per_rank  # a byte budget is split in proportion to the charge
    if budget["form"] == "max_tokens":
        need = max(g.pages_per_request for g in report.groups) * budget["tokens_per_block"]
        return f"give at least {option} {need} (every group holds that many token slots)"
    if budget["form"] == "memory_fraction":
        device = budget["device_memory_gib"] * GIB
        if need_bytes > device:
            return (
                f"one request needs {format_bytes(need_bytes)} per rank, more than the whole device "
                f"(--device-memory-gib {budget['device_memory_gib']})"
            )
        return f"give at least {option} {_ceil_to(need_bytes / device)} ({format_bytes(need_bytes)} per rank)"
    return f"give at least {option} {_ceil_to(need_bytes / GIB)} ({format_bytes(need_bytes)} per rank)"


def _shortfall_message(report: PoolReport, budget: dict, tokens_per_block: int, target: bool = False) -> str | None:
    """One line naming the budget option, every short group with both numbers, and the least budget."""
    short = report.shortfalls()
    if not short:
        return None
    option = _budget_option(budget, target)
    parts = []
    for i, g in short:
        window = "full attention" if g.window is None else f"window {g.window}"
        parts.append(
            f"group {i} ({window}, {g.num_layers} layers): the budget buys {g.pool_pages} pages but one request "
            f"needs {g.pages_per_request} pages (the unaligned charge; {g.aligned_pages_per_request} with the "
            f"aligned, pages of {tokens_per_block} tokens)"
        )
    least = _least_budget(report, {**budget, "tokens_per_block": tokens_per_block}, option)
    return f"argument {option}: the {report.name} pool cannot hold one request: " + "; ".join(parts) + f"; {least}"


def _page_limit_message(report: PoolReport, budget: dict, target: bool = False) -> str | None:
    """A budget buying more pages than 32-bit page indices address: the option and the limit."""
    over = [(i, g) for i, g in enumerate(report.groups) if g.pool_pages > MAX_POOL_PAGES]
    if not over:
        return None
    option = _budget_option(budget, target)
    groups = ", ".join(f"group {i} {g.pool_pages} pages" for i, g in over)
    return (
        f"argument {option}: the {report.name} pool would hold more pages than a pool can address ({groups}; at "
        f"most {MAX_POOL_PAGES}, page indices are 32-bit); give a smaller {option}"
    )


def _inputs(args: argparse.Namespace) -> dict:
    out = {}
    for key, value in vars(args).items():
        if key.startswith("_") or key == "command":
            continue
        out[key] = value.label if isinstance(value, SpeculativeDecodingMode) else value
    return out


def _plan_draft(args: argparse.Namespace, dtype: torch.dtype, common: dict) -> tuple[PoolGeometry, PoolReport, dict]:
    """The draft pool: its geometry, its report, and its budget as the JSON and the text show it."""
    mode = args.drafter
    geometry = PoolGeometry(
        _groups(args.num_layers, args.window, args.num_full_layers),
        args.num_kv_heads, args.head_dim, dtype, args.tokens_per_block, tp_size=args.tp,
    )
    budget_kw, budget = _draft_budget(args)
    report = plan_pool(
        f"draft ({mode.label})", geometry, **budget_kw, **common,
        num_extra_kv_tokens=args.num_extra_kv_tokens,
        trail_tokens=trail_tokens_for(mode, geometry, is_draft_pool=True),
    )
    return geometry, report, budget


def _plan_target(
    args: argparse.Namespace, dtype: torch.dtype, common: dict,
) -> tuple[PoolGeometry | None, PoolReport | None, dict | None]:
    """The target pool as :func:`_plan_draft` gives the draft one; three Nones without target layers."""
    target_groups = _groups(args.target_num_layers, args.target_window, args.target_num_full_layers)
    if not target_groups:
        return None, None, None
    target = PoolGeometry(
        target_groups, args.target_num_kv_heads, args.target_head_dim, dtype, args.tokens_per_block,
        tp_size=args.tp,
    )
    target_kw, target_budget = _target_budget(args)
    target_report = plan_pool(
        "target", target, **target_kw, **common, num_extra_kv_tokens=args.target_num_extra_kv_tokens
    )
    return target, target_report, target_budget


def _print_draft(args: argparse.Namespace, geometry: PoolGeometry, report: PoolReport, result: dict) -> str | None:
    """Print the draft pool's table, budget and savings, fill them into ``result``; return its shortfall."""
    budget = result["draft"]["budget"]
    print(format_report(report, args.tokens_per_block))
    print(_budget_line(budget, report))
    if args.shared_prefix:
        saved = prefix_reuse_savings(report.name, geometry, args.shared_prefix, trail_tokens=report.trail_tokens)
        print(format_savings(saved))
        result["draft"]["shared_prefix_savings"] = saved.to_dict()
    return _shortfall_message(report, budget, args.tokens_per_block)


def _print_target(
    args: argparse.Namespace, target: PoolGeometry, target_report: PoolReport, target_budget: dict,
    report: PoolReport, result: dict,
) -> str | None:
    """Print the target pool and what both pools hold together, fill them into ``result``; return its shortfall."""
    print()
    print(format_report(target_report, args.tokens_per_block))
    print(_budget_line(target_budget, target_report))
    if args.shared_prefix:
        saved = prefix_reuse_savings("target", target, args.shared_prefix)
        print(format_savings(saved))
        result["target_shared_prefix_savings"] = saved.to_dict()
    both = min(report.max_concurrency, target_report.max_concurrency)
    both_aligned = min(report.max_concurrency_aligned, target_report.max_concurrency_aligned)
    print(f"\nconcurrent requests both pools hold: {both} ({both_aligned} with the aligned charge)")
    result["target"] = {**target_report.to_dict(), "budget": target_budget}
    result["max_concurrency"] = both
    result["max_concurrency_aligned"] = both_aligned
    return _shortfall_message(target_report, target_budget, args.tokens_per_block, target=True)


def _write_json(parser: argparse.ArgumentParser, path: str, result: dict) -> bool:
    """Write ``result`` to ``path``; on failure say why on stderr and return False."""
    try:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
    except OSError as err:
        print(f"{parser.prog}: error: argument --json: cannot write {path!r}: {err.strerror or err}",
              file=sys.stderr)
        return False
    return True


def run_plan(args: argparse.Namespace) -> int:
    parser = _parser(args)
    _check(args, parser)
    dtype = parse_dtype(args.dtype)
    common = dict(max_seq_len=args.max_seq_len, chunk=args.chunk, max_draft_len=args.max_draft_len)
    geometry, report, budget = _plan_draft(args, dtype, common)
    target, target_report, target_budget = _plan_target(args, dtype, common)
    # A budget past what a pool can address is a bad input: refused before any table.
    for message in (_page_limit_message(report, budget), target_report and _page_limit_message(
            target_report, target_budget, target=True)):
        if message:
            parser.error(message)

    result = {"inputs": _inputs(args), "draft": {**report.to_dict(), "budget": budget}}
    errors = [_print_draft(args, geometry, report, result)]
    if target_report is not None:
        errors.append(_print_target(args, target, target_report, target_budget, report, result))
    else:
        result["target"] = None
        result["max_concurrency"] = report.max_concurrency
        result["max_concurrency_aligned"] = report.max_concurrency_aligned
    errors = [e for e in errors if e]
    result["errors"] = errors

    if args.json is not None and not _write_json(parser, args.json, result):
        return 1
    for message in errors:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 1 if errors else 0
