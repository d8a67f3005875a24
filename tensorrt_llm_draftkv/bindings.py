"""The two small enums TensorRT-LLM's KV cache constructor takes from its C++ bindings.

`CacheType` says what one cache entry holds (K and V, K only, or cross
attention); `DataType` is the element type of the pools. Both mirror upstream's
member names so an executor's `CacheType.SELF` / `DataType.BF16` work unchanged.
"""
from __future__ import annotations

import enum

import torch


class CacheType(enum.IntEnum):
    """What a cache stores per token: SELF (K and V), CROSS (encoder K and V), SELFKONLY (K only)."""

    SELF = 0
    CROSS = 1
    SELFKONLY = 2

    @property
    def kv_factor(self) -> int:
        """Tensors per token and layer: 2 (K and V), or 1 for a K-only cache."""
        return 1 if self is CacheType.SELFKONLY else 2


class DataType(enum.IntEnum):
    """Pool element types, named as upstream's `tensorrt_llm.bindings.DataType`."""

    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    NVFP4 = 10

    def to_torch(self) -> torch.dtype:
        """The torch dtype a pool of this type is allocated with; ValueError for types no pool uses."""
        try:
            return _TORCH[self]
        except KeyError:
            raise ValueError(
                f"DataType.{self.name} is not a KV pool element type here; use one of "
                f"{', '.join('DataType.' + t.name for t in _TORCH)}"
            ) from None

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "DataType":
        """The member for a torch dtype (ValueError naming the dtype otherwise)."""
        for member, torch_dtype in _TORCH.items():
            if torch_dtype == dtype:
                return member
        raise ValueError(f"no DataType for torch dtype {dtype}")


_TORCH: dict[DataType, torch.dtype] = {
    DataType.FLOAT: torch.float32,
    DataType.HALF: torch.float16,
    DataType.BF16: torch.bfloat16,
    DataType.FP8: torch.float8_e4m3fn,
    DataType.INT8: torch.int8,
}
