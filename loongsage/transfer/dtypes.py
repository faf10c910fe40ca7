"""Dtype names on the wire (SGLang's `dtypes` fields) and torch dtypes."""
from __future__ import annotations

import torch

DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "int64": torch.int64, "int32": torch.int32,
}


def dtype_from_name(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
