"""The registry of the draft-KV block-table kernels' Triton bodies, one module each.

The bodies (``_decode_kernel.py``, ``_rebase_kernel.py``, ``_prepare_kernel.py``,
``_one_pass_kernel.py``, ``_ring_kernel.py``) are plain Python functions written in ``triton.language``.
They are wrapped twice, lazily, by :func:`get_kernel`:

* a compiled ``JITFunction`` for CUDA tensors, and
* an ``InterpretedFunction`` for CPU tensors (Triton's interpreter),

independently of whether ``TRITON_INTERPRET`` was set when this module was
imported. The dispatch policy (which one runs when) lives in ``_dispatch.py``.

Layout conventions shared by the three two-step kernels (the one-pass kernel
lives in ``_one_pass_kernel.py`` and documents its own: a program per row, or a
few per long row, looping over tiles):

* grid axis 0 is the batch row ``b``; grid axis 1 is a chunk of ``BLOCK``
  consecutive block ordinals of that row;
* the program with chunk 0 of a row also writes that row's scalar outputs
  (extent, shift, lengths, query positions, store targets), so each kernel is a
  single launch and every output element is written exactly once;
* row offsets are computed in int64 (``B * M`` may exceed 2**31 elements in a
  strided parent tensor), column offsets in int32 (``M < 2**31``).
"""
from __future__ import annotations

import os

import triton  # noqa: F401  (absent triton: the ImportError `_dispatch` turns into HAVE_TRITON False)
from triton.runtime.jit import JITFunction

from ._decode_kernel import decode_kernel
from ._host_scatter_kernel import host_scatter_kernel
from ._one_pass_kernel import one_pass_kernel
from ._prepare_kernel import prepare_kernel
from ._rebase_kernel import rebase_kernel
from ._ring_kernel import ring_kernel


_BODIES = {
    "decode_draft_block_table": decode_kernel,
    "rebase_block_table": rebase_kernel,
    "prepare_paged_latent": prepare_kernel,
    "prepare_paged_latent_one_pass": one_pass_kernel,
    "prepare_paged_latent_ring": ring_kernel,
    # the same body with its per-row scalars staged by the host (``STAGED``): a name of its own, so
    # launches are counted apart and each form keeps its own compiled variants
    "prepare_ring_staged": ring_kernel,
    "host_scatter": host_scatter_kernel,
}

# ``max_ctx`` is converted with ``.to`` inside the body, so it must stay a
# runtime value even when it equals 1. ``M`` stays specialisable: its
# divisibility by 16 lets the ``cols < M`` store masks vectorise.
_NO_SPECIALIZE = {
    "decode_draft_block_table": [],
    "rebase_block_table": [],
    "prepare_paged_latent": ["max_ctx"],
    "prepare_paged_latent_ring": ["max_ctx"],
    "prepare_ring_staged": ["max_ctx"],
    # sizes and offsets change every call: one compiled kernel for all of them
    "host_scatter": ["n", "val_at", "m", "copy_at"],
    # every integer stays a runtime value: the fast launcher's cache key then only
    # needs each integer's width (alignment hints are explicit constexprs)
    "prepare_paged_latent_one_pass": [
        "M", "rows_q", "pool_off", "s_ob", "s_om", "divisor", "max_ctx", "block_size", "max_new", "window", "out_w",
    ],
}

# Pointers whose alignment is not specialised on: their accesses are scalars or
# shifted by a base, so an alignment hint buys nothing, and leaving it out keeps
# the fast launcher's cache key to dtypes (``rows_ptr`` stays specialised: its
# row stores vectorise).
_NO_ALIGN = {
    # the staged buffer is a claim at any int64 slot of the stager's arena
    "host_scatter": ["src64_ptr", "src32_ptr", "dst_ptr", "copy_ptr"],
    "prepare_paged_latent_one_pass": [
        "off_ptr", "slot_ptr", "ctx_ptr", "basep_ptr", "new_ptr", "lens_ptr", "qpos_ptr", "spage_ptr",
        "soff_ptr", "nctx_ptr", "shift_ptr", "ext_ptr",
    ],
}



_compiled: dict = {}
_interpreted: dict = {}


def _refuse_interpreter_mode(name: str) -> None:
    """Triton's interpreter mode is process-wide and its code generator cannot compile under it: say so
    plainly, before Triton fails deep in compilation (checked once per kernel, when it is first wrapped)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(
            f"{name}: CUDA tensors need the compiled kernel, but TRITON_INTERPRET=1 is set, and under it "
            "Triton compiles nothing for the GPU; unset it (or set TRITON_INTERPRET=0) before triton is imported"
        )


def get_kernel(name: str, interpreted: bool):
    """Return the compiled (CUDA) or interpreted (CPU) wrapper of kernel ``name``."""
    cache = _interpreted if interpreted else _compiled
    kern = cache.get(name)
    if kern is None:
        body = _BODIES[name]
        if interpreted:
            from triton.runtime.interpreter import InterpretedFunction

            kern = InterpretedFunction(body)
        else:
            _refuse_interpreter_mode(name)
            kern = JITFunction(
                body,
                do_not_specialize=_NO_SPECIALIZE[name],
                do_not_specialize_on_alignment=_NO_ALIGN.get(name),
            )
        cache[name] = kern
    return kern


__all__ = ["get_kernel"]
