"""Tensor properties as the format stores them: ``[dtype, layout, requires_grad, memory_format, pin_memory]``."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..metadata import TensorProperties
from .dtypes import dtype_from_name, dtype_name

_MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                   "channels_last_3d": torch.channels_last_3d, "preserve": torch.preserve_format}
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}


def enc_props(p: TensorProperties) -> list:
    mf = next((k for k, v in _MEMORY_FORMATS.items() if v == p.memory_format), "contiguous")
    layout = next((k for k, v in _LAYOUTS.items() if v == p.layout), "strided")
    return [dtype_name(p.dtype), layout, bool(p.requires_grad), mf, bool(p.pin_memory)]


DECODED_PROPS: dict[tuple, tuple] = {}  # property lists already checked (a few: dtypes x flags), as fields


def props_fields(data: Any, where: str) -> tuple:
    """The fields of a TensorProperties, from a stored properties list (checked)."""
    if type(data) is list and len(data) == 5:
        try:
            fields = DECODED_PROPS.get(tuple(data))
        except TypeError:  # an unhashable member: malformed, said below
            fields = None
        if fields is not None:
            return fields
    if not isinstance(data, list) or len(data) != 5:
        raise CorruptCheckpointError(f"{where}: malformed tensor properties {data!r:.200}")
    dt, layout, rg, mf, pin = data
    if (not isinstance(layout, str) or not isinstance(mf, str) or layout not in _LAYOUTS or mf not in _MEMORY_FORMATS
            or type(rg) is not bool or type(pin) is not bool):
        raise CorruptCheckpointError(f"{where}: malformed tensor properties {data!r:.200}")
    fields = (dtype_from_name(dt, where), _LAYOUTS[layout], rg, _MEMORY_FORMATS[mf], pin)
    if type(dt) is str and type(rg) is bool and type(pin) is bool and len(DECODED_PROPS) < 1024:
        DECODED_PROPS[tuple(data)] = fields
    return fields


def dec_props(data: Any, where: str) -> TensorProperties:
    return TensorProperties(*props_fields(data, where))  # a new object each time: planners may change one in place
