"""The combine function the compiled Triton bodies reduce with (``tl.reduce(x, 0, max_combine)``)."""
import triton.language as tl
from triton.runtime.jit import JITFunction


def max_combine_body(a, b):
    return tl.maximum(a, b)


# Built explicitly as a compiled JITFunction: under TRITON_INTERPRET=1 (set by
# the test suite) ``tl.max`` and the other standard-library reductions are
# interpreter objects, and calling one while *compiling* a CUDA kernel breaks
# the compiler. The compiled bodies therefore reduce with ``tl.reduce`` and
# this combine function; the interpreted bodies use ``tl.max``.
max_combine = JITFunction(max_combine_body)

__all__ = ["max_combine"]
