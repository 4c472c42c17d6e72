"""Crafting torch.save archives for the tests of distckpt's archive reader: any pickle, any records."""

from __future__ import annotations

import collections
import io
import pickle
import zipfile

import torch
import torch._utils


class Storage:
    """A storage the pickle names by persistent id."""

    def __init__(self, key, kind, count):
        self.key, self.kind, self.count = key, kind, count


class Tensor:
    """A tensor the pickle rebuilds over a Storage with the given offset, size and stride."""

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, self.offset, torch.Size(self.size), tuple(self.stride), False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", obj.kind, obj.key, "cpu", obj.count) if isinstance(obj, Storage) else None


def archive(obj, records: dict) -> bytes:
    """A torch.save-style zip of ``obj`` (its tensors Tensor objects) and storage records by key."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", b"little")
        for key, data in records.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", b"3\n")
    return out.getvalue()


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
