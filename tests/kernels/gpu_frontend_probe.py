"""Build every Triton kernel body of the package to Triton IR for an sm_90 GPU, on any machine.

Run in a process without ``TRITON_INTERPRET=1`` (the interpreter mode is
process-wide and the code generator refuses to compile under it). Prints one
line per kernel and constexpr combination, then ``failures: N``. The code paths
guarded by ``COMPILED`` and the constexpr branches a CPU run never takes are
exactly what Triton's interpreter does not check.
"""
from __future__ import annotations

import inspect
import itertools
import sys

import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton._C.libtriton import ir
from triton.runtime.jit import JITFunction

from tensorrt_llm_draftkv.kernels import _triton_kernels

INT32_POINTERS = {"off_ptr", "tab_ptr", "rows_ptr", "spage_ptr", "soff_ptr", "out_ptr", "k_ptr", "src32_ptr", "dst_ptr"}
FLAGS = {"SPLIT": (1, 3), "UNIT_COL": (True, False), "FULL_ROWS": (True, False), "SRC_TILES": (True, False),
         "WINDOWED": (True, False), "WIDE_COL": (False, True), "DIV_SHIFT": (1, -1), "BACKEND_CPP": (True, False),
         "STAGED": (False, True), "WRITE_CTX": (False, True)}
FIXED = {"P": 32, "BLOCK": 128, "SCAN": 256, "QBLOCK": 16, "NBLOCK": 16, "ROW_ALIGN": 4, "COMPILED": True}


def constexpr_names(body) -> list[str]:
    return [n for n, p in inspect.signature(body).parameters.items() if p.annotation in (tl.constexpr, "tl.constexpr")]


def combos(names: list[str]):
    flags = [n for n in names if n in FLAGS]
    for values in itertools.product(*(FLAGS[n] for n in flags)):
        const = {n: FIXED[n] for n in names if n in FIXED}
        const.update(zip(flags, values))
        if const.get("WINDOWED") and const.get("SRC_TILES"):
            continue  # refused by the entry point
        if const.get("WRITE_CTX") and not const.get("STAGED"):
            continue  # only the staged form writes the slot lengths
        if "SCAN_TAIL" in names:
            const["SCAN_TAIL"] = const.get("SPLIT", 1) > 1 or bool(const.get("WINDOWED"))
        missing = [n for n in names if n not in const]
        if missing:
            raise SystemExit(f"no probe value for constexprs {missing}")
        yield const


def build(body, const: dict) -> None:
    fn = JITFunction(body)
    sig = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*i32" if n in INT32_POINTERS else "*i64"
        else:
            sig[n] = "i64" if n == "max_ctx" else "i32"
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    ASTSource(fn, sig, const).make_ir(target, options, backend.get_codegen_implementation(options),
                                      backend.get_module_map(), context)


def main() -> int:
    failures = 0
    seen = set()
    for name, body in _triton_kernels._BODIES.items():
        if body in seen:  # one body under two names (the ring form and its staged form)
            continue
        seen.add(body)
        for const in combos(constexpr_names(body)):
            flags = {k: v for k, v in const.items() if k in FLAGS}
            try:
                build(body, const)
                print("ok", name, flags)
            except Exception as e:  # report every failing combination
                failures += 1
                last = (str(e).strip().splitlines() or [repr(e)])[-1]
                print("FAIL", name, flags, type(e).__name__, last[:300])
    print(f"failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
