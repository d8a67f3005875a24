"""Dispatch of the block-table kernels: which implementation runs, and the one launch path.

``impl=None`` runs the Triton kernel on CUDA tensors, Triton's interpreter on
CPU tensors when ``TRITON_INTERPRET=1`` and the torch reference otherwise;
``"triton"`` forces the kernel, ``"reference"`` the reference. Every Triton
launch goes through :func:`_launch`, which counts it in ``LAUNCH_COUNTS`` and
takes the fast launcher on CUDA (``_launch.py``).
"""
from __future__ import annotations

import collections
import os
from typing import Any, Optional, Sequence

import torch

from . import _launch as _fl
from . import _one_pass_plans as _plans
from ._checks import check_impl

try:  # the references must stay usable where Triton cannot be imported
    from . import _triton_kernels as _tk

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    _tk = None
    HAVE_TRITON = False

#: Number of Triton launches per kernel name since import (host-side counter).
LAUNCH_COUNTS: "collections.Counter[str]" = collections.Counter()


def triton_runs(impl: Optional[str], device: torch.device) -> bool:
    """Whether a call with this ``impl`` on this device runs a Triton kernel (see the module docstring)."""
    check_impl(impl)
    if impl == "reference":
        return False
    if impl == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("impl='triton' requested but triton cannot be imported")
        if device.type not in ("cuda", "cpu"):
            raise RuntimeError(f"no Triton path for device {device}")
        return True
    if not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return False


def launch(
    name: str,
    device: torch.device,
    grid: tuple[int, int],
    args: Sequence,
    fast: bool = True,
    plan_key: Optional[tuple] = None,
    **meta: Any,
) -> None:
    """One launch of kernel ``name``: interpreted on CPU, else compiled (fast path if allowed).

    ``plan_key``: the one-pass form's call signature (see :func:`._one_pass_plans.plan_key`);
    when given, the compiled kernel and launch sizes are remembered under it.
    """
    interpreted = device.type != "cuda"
    kern = _tk.get_kernel(name, interpreted)
    LAUNCH_COUNTS[name] += 1
    if name == "decode_draft_block_table":
        meta["COMPILED"] = not interpreted
    if interpreted:
        kern[grid](*args, **meta)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index == torch.cuda.current_device():
        if fast and _fl.ENABLED:
            ck = _fl.launch_fast(kern, index, grid, args, meta)
            if plan_key is not None and ck is not None:
                _plans.remember_plan(plan_key, ck, index, grid, args, meta, kern)
        else:
            _fl.launch_normal(kern, grid, args, meta)
    else:  # Triton compiles and launches for the current device
        with torch.cuda.device(device):
            _fl.launch_normal(kern, grid, args, meta)
