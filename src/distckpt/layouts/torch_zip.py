"""The archive ``torch.save`` writes, read without ``torch.load``: its records located, its pickle restricted.

``torch.save`` writes a zip archive: a pickle (``<prefix>/data.pkl``) of the object, in which each tensor is a call
to torch's rebuild function over a storage named by a persistent id, and one record (``<prefix>/data/<key>``) per
storage holding its bytes as they are in memory. DCP stores every item as such an archive, and users keep state
dicts as one.

``torch.load`` trusts what the archive says about sizes: it builds a storage of the byte count the pickle claims
over a record of whatever length the archive holds, and inflates compressed records without a bound. Here
nothing is trusted: records must be stored uncompressed and lie inside the bytes at hand, the pickle may name only
the rebuild functions, storage types, dtypes and plain containers, and a tensor is handed out only as a
:class:`TensorRef` (a storage key, dtype, shape, stride and offset) whose extent is checked against its storage
record. Where a tensor's bytes lie in the archive is then known exactly, so a reader can read the rows it needs
and nothing else.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import knobs
from ..errors import CorruptCheckpointError, UnsafeValueError
from ..format.dtypes import itemsize
from .pickles import check_memo

__all__ = ["Archive", "TensorRef", "StorageRef", "open_archive", "unpickle_refs", "tensor_from", "materialise", "NotPlainData"]

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_LOCAL_MAGIC = b"PK\x03\x04"
_MAX_RECORDS = 1 << 20
_MAX_NODES = 10_000_000  # containers and leaves of the unpickled object, counted as the tree a walk of it visits


@dataclass(frozen=True)
class Record:
    """A record of the archive: its bytes lie at ``offset`` (absolute, in the file) for ``size`` bytes; ``crc32``
    is the zip's CRC-32 of them, checked wherever a record is read whole (:func:`check_crc`)."""

    offset: int
    size: int
    crc32: int = 0


@dataclass(frozen=True)
class StorageRef:
    """A storage the pickle names: its record key, element dtype and size in bytes (as the pickle claims)."""

    key: str
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor the pickle rebuilds, described, not built."""

    storage: StorageRef
    offset: int  # in elements of the storage's dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    def contiguous(self) -> bool:
        expected, acc = [], 1
        for n in reversed(self.size):
            expected.append(acc)
            acc *= max(n, 1)
        return all(n == 1 or s == e for n, s, e in zip(self.size, self.stride, reversed(expected)))

    def extent(self) -> tuple[int, int]:
        """The byte range [start, end) of the storage the tensor reads (empty for an empty tensor)."""
        size = itemsize(self.dtype)
        if any(n == 0 for n in self.size):
            return self.offset * size, self.offset * size
        last = self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride))
        return self.offset * size, (last + 1) * size

    def nbytes(self) -> int:
        count = 1
        for n in self.size:
            count *= n
        return count * itemsize(self.dtype)


class NotPlainData(Exception):
    """The pickle names a global outside what is read here: only ``torch.load`` of a trusted archive can build it."""


@dataclass
class Archive:
    """The records of a ``torch.save`` archive, by name, under its one prefix."""

    prefix: str
    records: dict[str, Record]
    where: str

    def record(self, name: str) -> Record:
        rec = self.records.get(f"{self.prefix}/{name}")
        if rec is None:
            raise CorruptCheckpointError(f"{self.where}: the torch.save archive has no record {name!r}; it is damaged or "
                                         "not torch.save output")
        return rec

    def storage(self, ref: StorageRef) -> Record:
        """The record of storage ``ref``, checked to hold exactly the bytes the pickle claims."""
        rec = self.record(f"data/{ref.key}")
        if rec.size != ref.nbytes:
            raise CorruptCheckpointError(f"{self.where}: storage {ref.key!r} holds {rec.size} bytes, but the pickle claims "
                                         f"{ref.nbytes}; the archive is damaged or forged")
        return rec


class _PreadFile(io.RawIOBase):
    """A seekable read-only file over ``pread(n, offset)`` of a blob of ``size`` bytes, for :mod:`zipfile`."""

    def __init__(self, pread: Callable[[int, int], bytes], size: int) -> None:
        self._pread, self._size, self._pos = pread, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._size + offset
        if self._pos < 0:
            raise OSError("seek before the start of the archive")
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._size - self._pos))
        data = self._pread(n, self._pos) if n else b""
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)


def open_archive(pread: Callable[[int, int], bytes], size: int, where: str, base: int = 0) -> Archive:
    """The records of the archive of ``size`` bytes that ``pread`` reads (offsets relative to the archive;
    records' offsets are reported plus ``base``). Every record must be stored uncompressed, unencrypted, inside
    the archive, under one common prefix, with no name twice."""
    try:
        zf = zipfile.ZipFile(io.BufferedReader(_PreadFile(pread, size), 1 << 16))
        infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, UnicodeDecodeError, NotImplementedError) as exc:
        raise CorruptCheckpointError(f"{where}: not a torch.save archive ({type(exc).__name__}: {exc})") from None
    if not infos or len(infos) > _MAX_RECORDS:
        raise CorruptCheckpointError(f"{where}: a torch.save archive with {len(infos)} records")
    prefix = infos[0].filename.partition("/")[0]
    records: dict[str, Record] = {}
    for info in infos:
        name = info.filename
        if name in records or not name.startswith(prefix + "/"):
            raise CorruptCheckpointError(f"{where}: the torch.save archive lists {name!r} twice or outside its prefix")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1 or info.compress_size != info.file_size:
            raise CorruptCheckpointError(f"{where}: record {name!r} of the torch.save archive is compressed or encrypted; "
                                         "torch.save stores records as they are, so it was not written by torch.save")
        head = pread(_LOCAL_HEADER.size, info.header_offset) if 0 <= info.header_offset <= size - _LOCAL_HEADER.size else b""
        if len(head) != _LOCAL_HEADER.size:
            raise CorruptCheckpointError(f"{where}: record {name!r} of the torch.save archive lies outside it")
        magic, _, flags, method, _, _, crc, csize, usize, name_len, extra_len = _LOCAL_HEADER.unpack(head)
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        raw_name = pread(name_len, info.header_offset + _LOCAL_HEADER.size)
        sizes_here = flags & 0x8 or (crc, csize, usize) == (info.CRC, info.file_size, info.file_size) or (
            csize == usize == 0xFFFFFFFF)  # zip64: the sizes are in the extra field
        if (magic != _LOCAL_MAGIC or method != zipfile.ZIP_STORED or flags & 0x1 or not sizes_here
                or raw_name != name.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace")):
            raise CorruptCheckpointError(f"{where}: the local header of record {name!r} disagrees with the archive's "
                                         "directory; the archive is damaged or forged")
        if start + info.file_size > size:
            raise CorruptCheckpointError(f"{where}: record {name!r} of the torch.save archive lies outside it "
                                         f"(bytes {start}..{start + info.file_size} of {size})")
        records[name] = Record(base + start, info.file_size, info.CRC)
    _check_alignment(records, prefix, pread, base, where)
    spans = sorted((rec.offset, rec.offset + rec.size, name) for name, rec in records.items())
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CorruptCheckpointError(f"{where}: records {first!r} and {second!r} of the torch.save archive overlap")
    return Archive(prefix, records, where)


def _check_alignment(records: dict[str, Record], prefix: str, pread: Callable[[int, int], bytes], base: int, where: str) -> None:
    """Where the archive records the alignment torch.save gave its storages (``.storage_alignment``), every storage
    record must start on it: a local header that lies about its length shifts the bytes off it."""
    rec = records.get(f"{prefix}/.storage_alignment")
    if rec is None:
        return
    text = pread(min(rec.size, 16), rec.offset - base)
    if not text.isdigit() or not 0 < int(text) <= 1 << 20:
        raise CorruptCheckpointError(f"{where}: the torch.save archive's .storage_alignment is {text!r}")
    align = int(text)
    for name, r in records.items():
        if name.startswith(f"{prefix}/data/") and (r.offset - base) % align:
            raise CorruptCheckpointError(f"{where}: record {name!r} starts at byte {r.offset - base}, off the archive's "
                                         f"alignment of {align}; its local header lies")


_STORAGE_DTYPES = {name: getattr(torch, dtype) for name, dtype in {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128"}.items()}
_UNTYPED = object()


def _int(value: Any, what: str, where: str, low: int = 0) -> int:
    if type(value) is not int or value < low or value >= 1 << 62:
        raise CorruptCheckpointError(f"{where}: the torch.save pickle gives {what} {value!r}")
    return value


def _shape(value: Any, what: str, where: str) -> tuple[int, ...]:
    if isinstance(value, torch.Size):
        value = tuple(value)
    if not isinstance(value, tuple) or len(value) > 64:
        raise CorruptCheckpointError(f"{where}: the torch.save pickle gives {what} {value!r}")
    return tuple(_int(v, what, where) for v in value)


class _Rebuilder:
    """What the restricted unpickler builds tensors and storages with. It holds no reference to the unpickler: a
    load that fails leaves these functions on the C unpickler's stack, which the garbage collector cannot see, so a
    cycle through the unpickler would never be freed."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.storages: dict[str, StorageRef] = {}

    def storage(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)):
            raise CorruptCheckpointError(f"{self.where}: the torch.save pickle names a storage as {pid!r:.200}")
        _, kind, key, _location, count = pid
        count = _int(count, "a storage size", self.where)
        if kind is _UNTYPED:
            dtype, nbytes = torch.uint8, count
        elif isinstance(kind, torch.dtype):
            dtype, nbytes = kind, count * itemsize(kind)
        else:
            raise CorruptCheckpointError(f"{self.where}: the torch.save pickle names storage {key!r} of type {kind!r:.100}")
        ref = StorageRef(key, dtype, nbytes)
        if self.storages.setdefault(key, ref) != ref:
            raise CorruptCheckpointError(f"{self.where}: the torch.save pickle gives storage {key!r} two sizes or two dtypes")
        return self.storages[key]

    def v2(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False, *rest: Any) -> TensorRef:
        if not isinstance(storage, StorageRef):
            raise CorruptCheckpointError(f"{self.where}: the torch.save pickle rebuilds a tensor over {storage!r:.100}")
        return self.ref(storage, offset, size, stride, requires_grad, storage.dtype)

    def v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
           *rest: Any) -> TensorRef:
        if not isinstance(storage, StorageRef) or not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{self.where}: the torch.save pickle rebuilds a tensor over {storage!r:.100}")
        return self.ref(storage, offset, size, stride, requires_grad, dtype)

    def ref(self, storage: StorageRef, offset: Any, size: Any, stride: Any, requires_grad: Any, dtype: torch.dtype) -> TensorRef:
        size, stride = _shape(size, "a tensor size", self.where), _shape(stride, "a tensor stride", self.where)
        if len(size) != len(stride):
            raise CorruptCheckpointError(f"{self.where}: the torch.save pickle gives size {size} and stride {stride}")
        if storage.dtype != torch.uint8 and storage.dtype != dtype:
            raise CorruptCheckpointError(f"{self.where}: a {dtype} tensor over a {storage.dtype} storage")
        ref = TensorRef(storage, _int(offset, "a storage offset", self.where), size, stride, dtype, bool(requires_grad))
        start, end = ref.extent()
        if end > storage.nbytes:
            raise CorruptCheckpointError(f"{self.where}: a tensor of size {list(size)} reads bytes {start}..{end} of storage "
                                         f"{storage.key!r}, which holds {storage.nbytes}; the archive is damaged or forged")
        return ref


def _parameter(data: Any, requires_grad: Any, hooks: Any, *rest: Any) -> Any:
    return data


class _Unpickler(pickle.Unpickler):
    """Builds the pickled object with every tensor as a :class:`TensorRef`; names only torch's rebuild functions,
    storage types, dtypes, ``torch.Size`` and plain containers. Any other global raises :class:`NotPlainData`."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.rebuild = _Rebuilder(where)

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return self.rebuild.v2 if name == "_rebuild_tensor_v2" else self.rebuild.v3
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("torch.storage", "UntypedStorage") or (module, name) == ("torch", "UntypedStorage"):
            return _UNTYPED
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, torch.dtype):
                return value
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "builtins" and name in ("set", "frozenset", "complex", "slice"):
            return {"set": set, "frozenset": frozenset, "complex": complex, "slice": slice}[name]
        raise NotPlainData(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return self.rebuild.storage(pid)


def unpickle_refs(archive: Archive, pread: Callable[[int, int], bytes], where: str, max_bytes: int) -> Any:
    """The archive's object, tensors as :class:`TensorRef`; raises :class:`NotPlainData` for anything else it would
    take code to build. Byte order must be little-endian, the pickle at most ``max_bytes``."""
    order = archive.records.get(f"{archive.prefix}/byteorder")
    if order is not None and pread(order.size, order.offset) not in (b"little",):
        raise CorruptCheckpointError(f"{where}: the torch.save archive is big-endian, which distckpt does not read")
    rec = archive.record("data.pkl")
    if rec.size > max_bytes:
        raise CorruptCheckpointError(f"{where}: the torch.save pickle is {rec.size} bytes, over the cap of {max_bytes}")
    data = pread(rec.size, rec.offset)
    check_crc(rec, data, "data.pkl", where)
    check_memo(data, where)
    unpickler = _Unpickler(data, where)
    try:
        obj = unpickler.load()
        _check_tree(obj, where, _MAX_NODES)
        return obj
    except (NotPlainData, CorruptCheckpointError):
        raise
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: the torch.save pickle nests too deeply") from None
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything the unpickler raises
        raise CorruptCheckpointError(f"{where}: the torch.save pickle is damaged ({type(exc).__name__}: {exc})") from None


def check_crc(rec: Record, data: Any, name: str, where: str) -> None:
    """Raise where the bytes of a whole record differ from the zip's CRC-32 of them."""
    got = zlib.crc32(data)
    if got != rec.crc32:
        raise CorruptCheckpointError(f"{where}: record {name!r} of the torch.save archive fails its CRC-32 (stored "
                                     f"{rec.crc32:08x}, computed {got:08x}); the file is damaged")


def _check_tree(obj: Any, where: str, limit: int) -> None:
    """Raise where walking ``obj`` as a tree (as flattening and copying do) would visit more than ``limit`` nodes:
    a pickle can reference one container many times, and a few hundred bytes can then stand for 2**40 paths."""
    count = 0
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > limit or depth > 64:
            raise CorruptCheckpointError(f"{where}: the torch.save pickle describes a structure of more than {limit} "
                                         "nodes, or nested deeper than 64 levels, when walked (containers referenced many "
                                         "times); it is damaged or forged")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            count += len(node)
        elif isinstance(node, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in node)


def tensor_from(archive: Archive, ref: TensorRef, pread: Callable[[int, int], bytes], cache: Optional[dict] = None,
                limit: Optional[int] = None) -> torch.Tensor:
    """The tensor ``ref`` describes, viewing its storage's bytes, read once per ``cache`` from the archive ``pread``
    reads and checked against the record's CRC-32 (as ``torch.load``, tensors over one storage share it). A view
    larger than its storage (overlapping strides, a stride of 0) may not exceed ``limit`` bytes (default
    DISTCKPT_MAX_VALUE_BYTES): whoever copies it would allocate all of it."""
    rec = archive.storage(ref.storage)
    flat = None if cache is None else cache.get(ref.storage.key)
    if flat is None:
        raw = pread(rec.size, rec.offset)
        if len(raw) != rec.size:
            raise CorruptCheckpointError(f"{archive.where}: storage {ref.storage.key!r} lies outside the archive")
        check_crc(rec, raw, f"data/{ref.storage.key}", archive.where)
        if rec.size:  # writable memory ``pread`` returned is the caller's to give: viewed, not copied (held once)
            owned = isinstance(raw, bytearray) or (isinstance(raw, memoryview) and not raw.readonly)
            flat = torch.frombuffer(raw if owned else bytearray(raw), dtype=torch.uint8)
        else:
            flat = torch.empty(0, dtype=torch.uint8)
        if cache is not None:
            cache[ref.storage.key] = flat
    limit = knobs.max_value_bytes() if limit is None else limit
    if ref.nbytes() > max(rec.size, limit):
        raise CorruptCheckpointError(
            f"{archive.where}: a tensor of size {list(ref.size)} ({ref.nbytes()} bytes) views storage {ref.storage.key!r} of "
            f"{rec.size} bytes through strides {list(ref.stride)}; over the cap of {limit} bytes (DISTCKPT_MAX_VALUE_BYTES) "
            "for such views")
    if flat.numel() % itemsize(ref.dtype):
        raise CorruptCheckpointError(f"{archive.where}: storage {ref.storage.key!r} is not a whole number of {ref.dtype}")
    return flat.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)


def materialise(obj: Any, archive: Archive, pread: Callable[[int, int], bytes], cache: Optional[dict] = None,
                depth: int = 0) -> Any:
    """``obj`` with every :class:`TensorRef` in it replaced by its tensor (see :func:`tensor_from`)."""
    cache = {} if cache is None else cache
    if depth > 64:
        raise UnsafeValueError(f"{archive.where}: the object nests deeper than 64 levels")
    if isinstance(obj, TensorRef):
        return tensor_from(archive, obj, pread, cache)
    if type(obj) in (list, tuple, set, frozenset):
        return type(obj)(materialise(v, archive, pread, cache, depth + 1) for v in obj)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, collections.OrderedDict) else {}
        for k, v in obj.items():
            out[k] = materialise(v, archive, pread, cache, depth + 1)
        return out
    return obj
