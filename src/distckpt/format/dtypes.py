"""The dtypes a checkpoint may hold, and their names on disk.

Only dtypes in this table are accepted on load; anything else in a file is
rejected before allocation.
"""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError, UnsupportedTensorError

# name on disk -> (torch dtype, safetensors dtype code or None when stored as raw U8)
_TABLE: dict[str, tuple[torch.dtype, str | None]] = {
    "bool": (torch.bool, "BOOL"),
    "uint8": (torch.uint8, "U8"),
    "int8": (torch.int8, "I8"),
    "int16": (torch.int16, "I16"),
    "uint16": (torch.uint16, "U16"),
    "int32": (torch.int32, "I32"),
    "uint32": (torch.uint32, "U32"),
    "int64": (torch.int64, "I64"),
    "uint64": (torch.uint64, "U64"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float32": (torch.float32, "F32"),
    "float64": (torch.float64, "F64"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "complex64": (torch.complex64, None),
    "complex128": (torch.complex128, None),
}

_BY_DTYPE = {dt: name for name, (dt, _) in _TABLE.items()}
STORABLE_DTYPES = frozenset(_BY_DTYPE)
SAFETENSORS_CODES = {code for _, code in _TABLE.values() if code}
ITEMSIZE = {code: torch.empty((), dtype=dt).element_size() for dt, code in _TABLE.values() if code}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedTensorError(f"dtype {dtype} cannot be stored by distckpt; convert the tensor to one of {sorted(_TABLE)}") from None


def dtype_from_name(name: object, where: str = "metadata") -> torch.dtype:
    if not isinstance(name, str) or name not in _TABLE:
        raise CorruptCheckpointError(f"{where}: dtype {name!r} is not one of the allowed dtypes {sorted(_TABLE)}")
    return _TABLE[name][0]


def safetensors_code(dtype: torch.dtype) -> str:
    """The dtype code in a data file's header; dtypes safetensors lacks are stored as raw U8."""
    return _TABLE[dtype_name(dtype)][1] or "U8"


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def element_width(dtype: torch.dtype) -> int:
    """The bytes of one real number of ``dtype``: a complex number is two of its component type, whose bytes
    are alike (what byte-grouping codecs group by)."""
    return dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize
