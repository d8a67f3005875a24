"""Kernel launches: Triton's normal path, and a fast path that skips its per-call binding.

A ``JITFunction`` call (``kern[grid](*args, **meta)``) binds the arguments,
computes every argument's specialisation, hashes a cache key and looks the
compiled kernel up: tens of microseconds of Python per launch, more than the
kernels themselves take under CUDA-graph replay. The fast path does that work
once per *launch class* and then calls the compiled kernel's launcher directly.

A launch class is everything Triton specialises a compiled kernel on, or
finer: the kernel, the device, ``num_warps``, the constexpr values, each
tensor's dtype and whether its data pointer is 16-byte aligned, and for each
integer whether it is 1, whether it is a multiple of 16 and whether it fits in
int32. Because the class is at least as fine as Triton's own key, every launch
of one class runs the very kernel Triton would have picked. The first launch of
a class goes through the normal path, which compiles if needed, launches, and
returns the ``CompiledKernel`` stored for the next ones.

The fast path launches on the current CUDA stream (so it is recorded by a
CUDA-graph capture like any other launch) and never synchronises. It falls back
to the normal path when a launch hook is installed (profilers), when the
tensors live on a device other than the current one, or when the normal path
does not hand back a compiled kernel.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

_I32_LO, _I32_HI = -(2**31), 2**31

#: launch class -> CompiledKernel
_CACHE: dict[tuple, Any] = {}
#: id(JITFunction) -> names of its constexpr parameters, in signature order
_META_ORDER: dict[int, tuple[str, ...]] = {}

#: Master switch; ``DRAFTKV_FAST_LAUNCH=0`` turns the fast path off process-wide.
ENABLED: bool = os.environ.get("DRAFTKV_FAST_LAUNCH", "1") != "0"

try:  # what Triton itself reads the current stream with
    raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older torch
    def raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def _knobs():
    try:
        from triton import knobs

        return knobs.runtime
    except Exception:  # pragma: no cover - Triton without knobs
        return None


_RUNTIME = _knobs()


def _active(hook: Any) -> bool:
    # Triton 3.6 keeps an always-present HookChain; it only matters when it holds calls
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


def hooked() -> bool:
    rt = _RUNTIME
    return rt is not None and (_active(rt.launch_enter_hook) or _active(rt.launch_exit_hook))


def _meta_order(kern: Any, n_args: int) -> tuple[str, ...]:
    order = _META_ORDER.get(id(kern))
    if order is None:
        order = tuple(kern.arg_names[n_args:])
        _META_ORDER[id(kern)] = order
    return order


def launch_normal(kern: Any, grid: tuple[int, int], args: Sequence, meta: dict) -> Any:
    """Triton's own launch path; returns what it returns (the ``CompiledKernel``)."""
    return kern[grid](*args, **meta)


def launch_fast(kern: Any, device_index: int, grid: tuple[int, int], args: Sequence, meta: dict) -> Any:
    """Launch compiled ``kern`` on ``grid`` over ``args`` (tensors and ints, signature order).

    ``meta`` holds the constexprs (in signature order, after ``args``) and
    ``num_warps``. The tensors must be on the current CUDA device. Returns the
    ``CompiledKernel`` that ran (``None`` when the normal path gave none back).
    """
    if hooked():
        launch_normal(kern, grid, args, meta)
        return None
    k, vals = _launch_class(kern, device_index, args, meta)
    ck = _CACHE.get(k)
    if ck is None:
        ck = launch_normal(kern, grid, args, meta)
        if ck is not None and hasattr(ck, "result"):  # asynchronous compile mode
            ck = ck.result()
        if ck is not None and hasattr(ck, "packed_metadata"):
            _CACHE[k] = ck
            return ck
        return None
    vals.extend(meta[name] for name in _meta_order(kern, len(args)))
    ck.run(
        grid[0], grid[1], 1, raw_stream(device_index), ck.function, ck.packed_metadata, None, None, None, *vals
    )
    return ck


def _launch_class(kern: Any, device_index: int, args: Sequence, meta: dict) -> tuple[tuple, list]:
    """The launch class of a launch, and its arguments as the launcher takes them (pointers, ints)."""
    key: list = [id(kern), device_index]
    vals = []
    for a in args:
        if isinstance(a, torch.Tensor):
            p = a.data_ptr()
            key.append(a.dtype)
            key.append((p & 15) == 0)
            vals.append(p)
        else:
            a = int(a)
            key.append((a == 1, a & 15 == 0, _I32_LO <= a < _I32_HI))
            vals.append(a)
    for v in meta.items():
        key.append(v)
    return tuple(key), vals


def resolve(kern: Any, device_index: int, args: Sequence, meta: dict) -> Any:
    """``(run, launcher arguments after the stream)`` of a launch whose class was launched before
    (``launch_fast``), every pointer taken now; None when it was not. ``run(grid0, grid1, 1, stream,
    *arguments)`` then repeats that very launch: what a caller with fixed tensors relaunches."""
    k, vals = _launch_class(kern, device_index, args, meta)
    ck = _CACHE.get(k)
    if ck is None:
        return None
    vals.extend(meta[name] for name in _meta_order(kern, len(args)))
    return ck.run, (ck.function, ck.packed_metadata, None, None, None, *vals)


def cached_classes() -> int:
    """Number of launch classes bound so far (tests, benchmarks)."""
    return len(_CACHE)


def clear() -> None:
    """Forget every bound launch class (the next launch of each binds again)."""
    _CACHE.clear()
    for forget in ON_CLEAR:
        forget()


#: callbacks run by :func:`clear` (the entry points register their own caches)
ON_CLEAR: list = []


__all__ = ["ENABLED", "cached_classes", "clear", "launch_fast", "launch_normal", "resolve"]
