"""The metadata document: its text, its parser, and the JSON parts the wire's codecs share.

A checkpoint's metadata is one JSON document ending in the CRC-32C of what
precedes it (docs/format.md). Here are the rows it is written from (one
writer for both planning paths), the encoder of a whole Metadata, and the
parser, which checks the checksum and validates every field, location and
cover before it builds a Metadata (or, lazily, when one is first used),
raising CorruptCheckpointError or FormatVersionError on anything malformed.
The item indexes, chunks, properties and opaque values encoded here are also
what ``wire/`` sends between ranks (compact JSON, never pickle).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional, Union

import torch

from .. import knobs
from ..errors import CheckpointError, CorruptCheckpointError, FormatVersionError
from ..gc_pause import gc_paused
from ..metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from . import BASE_FORMAT_VERSION_STR, CODEC_FORMAT_VERSION_STR, FORMAT_NAME, FORMAT_VERSION_STR, REFERENCE_FORMAT_VERSION_STR
from .checksum import crc32c, format_crc
from .chunk_codec import CODEC_SEPARATOR, DECODED_CRC, IDENTITY, split_recorded
from .datafile import loads_json, quote
from .dtypes import itemsize
from .fields import MAX_INT as _MAX_INT
from .fields import ints as _ints
from .locations import add_item, check_cover, check_no_overlap, checked_chunk, cross_check, decode_file_table, inline_chunks, stored_codec
from .names import SAVE_ID, check_file_name
from .properties import DECODED_PROPS, dec_props, enc_props
from .records import FileInfo, FileStorageData, StorageInfo, split_reference
from .tensor_table import TableEntries, TableWriter, decode_table
from .values import from_data, to_data

MAX_KEYS = 10_000_000
MAX_CHUNKS = 10_000_000

# ---------------------------------------------------------------- small parts


def enc_index(index: MetadataIndex) -> list:
    return [index.fqn, None if index.offset is None else list(index.offset), index.index]


def dec_index(data: Any, where: str) -> MetadataIndex:
    if not isinstance(data, list) or len(data) != 3 or not isinstance(data[0], str):
        raise CorruptCheckpointError(f"{where}: malformed item index {data!r:.200}")
    hint = data[2]
    if hint is not None and (type(hint) is not int or hint < 0):
        raise CorruptCheckpointError(f"{where}: malformed chunk hint {hint!r}")
    return MetadataIndex(data[0], _ints(data[1], where, allow_none=True), hint)


def enc_chunk(c: ChunkStorageMetadata) -> list:
    return [list(c.offsets), list(c.sizes)]


def dec_chunk(data: Any, where: str) -> ChunkStorageMetadata:
    if not isinstance(data, list) or len(data) != 2:
        raise CorruptCheckpointError(f"{where}: malformed chunk {data!r:.200}")
    off, size = _ints(data[0], where), _ints(data[1], where)
    if len(off) != len(size):
        raise CorruptCheckpointError(f"{where}: chunk offsets and sizes differ in rank")
    return ChunkStorageMetadata(off, size)


def opaque_to(value: Any, where: str, transport: bool) -> Any:
    if isinstance(value, FileStorageData):
        return {"$fs": _enc_file_storage(value)}
    data = to_data(value, allow_pickle=transport and knobs.allow_pickle_transport(), where=where)
    if type(data) is dict and len(data) == 1 and ("$fs" in data or "$files" in data):
        # a dict whose one member has a name the document reserves (opaque_from, _parse_metadata) is written in its
        # tagged form, so it reads back as the dict it is, not as storage data
        return {"$t": "dict", "v": [[name, member] for name, member in data.items()]}
    return data


def opaque_from(data: Any, where: str, transport: bool) -> Any:
    if isinstance(data, dict) and len(data) == 1 and "$fs" in data:
        return _dec_file_storage(data["$fs"], where)
    return from_data(data, allow_pickle=transport and knobs.allow_pickle_transport(), where=where)


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def loads(raw: bytes, where: str) -> Any:
    try:
        return loads_json(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON: {exc}") from None


# ---------------------------------------------------------------- storage data


def _enc_file_storage(fs: FileStorageData) -> dict:
    return {
        "save_id": fs.save_id,
        "files": {name: [info.size, info.rank, format_crc(info.header_crc32c)] for name, info in sorted(fs.files.items())},
        "items": [[idx.fqn, None if idx.offset is None else list(idx.offset), si.file, si.offset, si.length, format_crc(si.crc32c)]
                  for idx, si in fs.items.items()],
    }


def _dec_file_storage(data: Any, where: str) -> FileStorageData:

    if not isinstance(data, dict) or set(data) != {"save_id", "files", "items"}:
        raise CorruptCheckpointError(f"{where}: malformed storage data")
    save_id, files_raw, items_raw = data["save_id"], data["files"], data["items"]
    if not isinstance(save_id, str) or not isinstance(files_raw, dict) or not isinstance(items_raw, list):
        raise CorruptCheckpointError(f"{where}: malformed storage data")
    files = {}
    for name, info in files_raw.items():
        check_file_name(name, where)
        if not (isinstance(info, list) and len(info) == 3 and all(type(x) is int and 0 <= x <= _MAX_INT for x in info[:2])):
            raise CorruptCheckpointError(f"{where}: malformed entry for data file {name!r}")
        files[name] = FileInfo(info[0], info[1], _crc_field(info[2], f"{where}: data file {name!r}"))
    items = {}
    for entry in items_raw:
        if not (isinstance(entry, list) and len(entry) == 6 and isinstance(entry[0], str) and isinstance(entry[2], str)
                and entry[2] in files):
            raise CorruptCheckpointError(f"{where}: malformed storage item {entry!r:.200} (unknown file or bad shape)")
        fqn, off, fname, begin, length, crc = entry
        if not all(type(x) is int and 0 <= x <= _MAX_INT for x in (begin, length)) or begin + length > files[fname].size:
            raise CorruptCheckpointError(f"{where}: storage item {fqn!r} lies outside data file {fname!r}")
        index = MetadataIndex(fqn, _ints(off, where, allow_none=True))
        if index in items:
            raise CorruptCheckpointError(f"{where}: storage item {fqn!r} {entry[1]} is listed twice")
        items[index] = StorageInfo(fname, begin, length, _crc_field(crc, f"{where}: storage item {fqn!r}"))
    check_no_overlap(items, files, where)
    return FileStorageData(save_id, files, items)


def _crc_field(value: Any, where: str) -> int:
    if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{8}", value):
        return int(value, 16)
    raise CorruptCheckpointError(f"{where}: malformed checksum {value!r:.20}")


# ---------------------------------------------------------------- metadata document

_TRAILER = re.compile(rb',"crc32c":"([0-9a-f]{8})"}\n\Z')


@dataclasses.dataclass(frozen=True)
class StoredFiles:
    """What a committed metadata document says about data files: the id of the save that wrote it, its own files
    with their sizes, and the files of other checkpoints it references (format 4.0), ``<checkpoint>/<file>`` to
    (size, id of the save that stored it)."""

    save_id: str
    own: dict
    references: dict

    def referenced_by_checkpoint(self) -> dict:
        """(checkpoint, save id) -> the names of its files this document references."""
        out: dict = {}
        for key, (_, save_id) in self.references.items():
            checkpoint, name = split_reference(key)
            out.setdefault((checkpoint, save_id), set()).add(name)
        return out


def stored_files(document: bytes, where: str = "metadata document") -> Optional[StoredFiles]:
    """The data files the metadata document ``document`` lists, decided by the loader's own parsers (the checksum,
    the frame and version, the file table): a document written another way (members in another order, other
    spacing) gets the same answer, and a table anywhere but in ``storage_data`` is never read. None where its
    storage data is not distckpt's file table (another storage layer's document). Raises CorruptCheckpointError
    (FormatVersionError for a version this release does not read): a caller deciding what to delete then keeps
    everything the document might reference."""
    body, version, major = _document_body(document, where)
    storage_raw = body.get("storage_data")
    fsd = _inline_file_table(storage_raw, version, major, where)
    if fsd is None:
        fsd = opaque_from(storage_raw, f"{where}: storage_data", False)
        if not isinstance(fsd, FileStorageData):
            return None
    if not SAVE_ID.match(fsd.save_id):
        raise CorruptCheckpointError(f"{where}: save id {fsd.save_id!r:.80} is not 1 to 64 of [0-9A-Za-z_-]")
    own = {name: info.size for name, info in fsd.files.items() if info.save_id is None}
    refs = {name: (info.size, info.save_id) for name, info in fsd.files.items() if info.save_id is not None}
    return StoredFiles(fsd.save_id, own, refs)


SUPPORTED_MAJORS = (1, 2, 3, 4)


_PROPS_TEXT: dict[tuple, str] = {}  # a few distinct property lists: dtypes x requires_grad


def _join(values) -> str:
    return ",".join(map(str, values))


def tensor_row(size: list, properties: list, chunks: list) -> str:
    """A tensor's entry of ``state_dict_metadata``, as JSON text; each chunk is [offsets, sizes] or, with
    locations inline, [offsets, sizes, file number, offset, crc32c] (docs/format.md, section 3).

    Rows are written as text, not built as dicts for ``json.dumps``: a document of many small tensors is
    mostly rows, and this is its one writer for both planning paths (the text is what ``dumps`` gives)."""
    props = properties_text(properties)
    if len(chunks) == 1 and len(chunks[0]) == 5:  # most rows: one chunk stored as it is
        o, n, file_no, begin, crc = chunks[0]
        return (f'{{"type":"tensor","size":[{_join(size)}],"properties":{props},"chunks":[[[{_join(o)}],[{_join(n)}],'
                f'{file_no},{begin},{crc}]]}}')
    parts = []
    for c in chunks:
        head = f"[[{_join(c[0])}],[{_join(c[1])}]"
        if len(c) == 5:
            parts.append(f"{head},{c[2]},{c[3]},{c[4]}]")
        elif len(c) == 6:  # stored through a codec (format 2.1)
            parts.append(f"{head},{c[2]},{c[3]},{c[4]},{dumps(c[5]).decode()}]")
        else:
            parts.append(head + "]")
    return f'{{"type":"tensor","size":[{_join(size)}],"properties":{props},"chunks":[{",".join(parts)}]}}'


def properties_text(properties: list) -> str:
    """The JSON text of an encoded properties list (a few distinct ones per save: dtypes x requires_grad)."""
    props = _PROPS_TEXT.get(tuple(properties))
    if props is None:
        props = _PROPS_TEXT[tuple(properties)] = dumps(properties).decode()
    return props


def bytes_row(at: Optional[tuple]) -> str:
    """A value's entry of ``state_dict_metadata``, as JSON text; ``at`` is (file number, offset, length,
    crc32c) and, when stored through a codec (format 2.1), its codec record; or None where locations are not inline."""
    if at is None:
        return '{"type":"bytes"}'
    if len(at) == 5:
        return f'{{"type":"bytes","at":[{_join(at[:4])},{dumps(at[4]).decode()}]}}'
    return f'{{"type":"bytes","at":[{_join(at)}]}}'


def codec_record(codec: str, length: int, tensor: bool) -> dict:
    """The record a chunk or value stored through ``codec`` carries (format 2.1): the codec's parts, and for a
    tensor chunk the stored length (a value's is its location's); format 4.0: the CRC-32C of the decoded bytes, where
    the in-memory name carries one (:data:`~.chunk_codec.DECODED_CRC`)."""
    name, crc = split_recorded(codec)
    record: dict = {"codec": name.split(CODEC_SEPARATOR), "length": length} if tensor else {"codec": name.split(CODEC_SEPARATOR)}
    if crc is not None:  # the CRC-32C of the decoded bytes (format 4.0)
        record["crc32c"] = crc
    return record


def file_table(save_id: str, files: list) -> dict:
    """``storage_data`` of a document with inline locations: the save id and [name, size, rank, header crc] per file,
    and the id of the save that stored it for a file of another checkpoint (format 4.0)."""
    return {"$files": {"save_id": save_id, "files": files}}


def file_row(name: str, info: FileInfo) -> list:
    """A data file's row of the file table."""
    row = [name, info.size, info.rank, info.header_crc32c]
    return row if info.save_id is None else row + [info.save_id]


def encode_metadata(md: Metadata) -> bytes:
    """The metadata document (format 2.x): JSON whose last member is the CRC-32C of all bytes before it.

    With distckpt's own storage data (:class:`FileStorageData`) every chunk and
    value carries its location inline, and ``storage_data`` holds only the
    data-file table; other storage data is stored as a tagged value.
    """
    fsd = md.storage_data if isinstance(md.storage_data, FileStorageData) else None
    names = sorted(fsd.files) if fsd is not None else []
    file_no = {name: i for i, name in enumerate(names)}

    def where_is(index: MetadataIndex) -> StorageInfo:
        si = fsd.items.get(index)
        if si is None or si.file not in file_no:
            raise CheckpointError(f"key {index.fqn!r}: no stored location for {list(index.offset or [])} (internal error)")
        if si.codec != IDENTITY.name:
            coded.append(index)
        return si

    def record(si: StorageInfo, tensor: bool) -> list:
        return [] if si.codec == IDENTITY.name else [codec_record(si.codec, si.length, tensor)]

    coded: list = []

    sdm = {}
    table = TableWriter()
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            if fsd is not None and len(entry.chunks) == 1 and len(entry.size) <= 64:
                c = entry.chunks[0]
                if c.sizes == entry.size and not any(c.offsets) and len(c.offsets) == len(entry.size):
                    si = fsd.items.get(MetadataIndex(fqn, c.offsets))
                    if si is not None and si.file in file_no and si.codec == IDENTITY.name:  # stored as it is: a table row
                        table.add(fqn, list(entry.size), enc_props(entry.properties), file_no[si.file], si.offset, si.crc32c)
                        continue
            chunks = []
            for c in entry.chunks:
                row = [list(c.offsets), list(c.sizes)]
                if fsd is not None:
                    si = where_is(MetadataIndex(fqn, c.offsets))
                    row += [file_no[si.file], si.offset, si.crc32c] + record(si, True)
                chunks.append(row)
            sdm[fqn] = tensor_row(list(entry.size), enc_props(entry.properties), chunks)
        elif fsd is not None:
            si = where_is(MetadataIndex(fqn))
            sdm[fqn] = bytes_row((file_no[si.file], si.offset, si.length, si.crc32c, *record(si, False)))
        else:
            sdm[fqn] = bytes_row(None)
    if fsd is not None:
        storage = file_table(fsd.save_id, [file_row(n, fsd.files[n]) for n in names])
        referencing = any(info.save_id is not None for info in fsd.files.values())
    else:
        storage = opaque_to(md.storage_data, "metadata storage_data", False)
    return metadata_document(sdm, storage, opaque_to(md.planner_data, "metadata planner_data", False), md.storage_meta,
                             bool(coded), table, v4=fsd is not None and (referencing or _checks_decoded(fsd, coded)))


def _checks_decoded(fsd: FileStorageData, coded: list) -> bool:
    """Whether a codec record of the items ``coded`` holds the CRC-32C of decoded bytes (format 4.0)."""
    return any(DECODED_CRC in fsd.items[index].codec for index in coded)


_VERSION_AT_START = re.compile(rb'\{"format":"distckpt","format_version":"(\d{1,4}\.\d{1,4})"')


def written_version(document: bytes) -> str:
    """The format version a document this module wrote records (it is the document's second member)."""
    return _VERSION_AT_START.match(document).group(1).decode()


def metadata_document(sdm: Union[dict[str, str], list[str]], storage: Any, planner: Any, sm: Optional[StorageMeta],
                      coded: bool = False, table: Optional[TableWriter] = None, v4: bool = False) -> bytes:
    """Serialise the already-encoded members of a metadata document (``sdm``: key to the JSON text of its
    row, or the members' texts ``"key":row`` in order; ``table``: the whole tensors, listed before them) and
    append its checksum. The version written is the lowest that records what the document holds: 4.0 where it
    needs it (``v4``: a data file of another checkpoint), 3.0 with a table of whole tensors, else 2.1 where an
    item is stored through a codec (``coded``), else 2.0."""
    rows = ",".join(sdm if isinstance(sdm, list) else (f"{quote(fqn)}:{row}" for fqn, row in sdm.items()))
    meta = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)}
    version = (REFERENCE_FORMAT_VERSION_STR if v4 else FORMAT_VERSION_STR if table else CODEC_FORMAT_VERSION_STR if coded
               else BASE_FORMAT_VERSION_STR)
    prefix = b"".join((b'{"format":', dumps(FORMAT_NAME), b',"format_version":', dumps(version),
                       b"," + table.member(dumps) if table else b"",
                       b',"state_dict_metadata":{', rows.encode("utf-8"), b'},"storage_data":', dumps(storage),
                       b',"planner_data":', dumps(planner), b',"storage_meta":', dumps(meta)))
    return prefix + b',"crc32c":"' + format_crc(crc32c(prefix)).encode() + b'"}\n'


_METADATA_FIELDS = frozenset(("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"))


class EncodedMetadata(Metadata):
    """Metadata that came as a document: its checksum is checked at once, the rest is decoded on first use
    of any field.

    What save() returns on every rank: at thousands of ranks the document has
    millions of chunks, and most callers never look at it. ``document`` holds
    the exact bytes until a field is assigned; a storage layer's ``finish``
    commits them as they are.
    """

    def __init__(self, raw: bytes, where: str) -> None:  # noqa: D107 - replaces the dataclass __init__ on purpose
        check_document(raw, where)
        object.__setattr__(self, "_pending", (raw, where))
        object.__setattr__(self, "document", raw)

    def _decode(self) -> None:
        state = object.__getattribute__(self, "__dict__")
        pending = state.pop("_pending", None)
        if pending is not None:
            md = parse_metadata(*pending)
            state.update({name: getattr(md, name) for name in _METADATA_FIELDS})

    def __getattribute__(self, name: str) -> Any:
        if name in _METADATA_FIELDS:
            EncodedMetadata._decode(self)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        EncodedMetadata._decode(self)
        object.__setattr__(self, "document", None)  # the bytes no longer say what the fields say
        object.__setattr__(self, name, value)

    @property  # type: ignore[misc]
    def __class__(self):  # noqa: D105 - compares, copies and prints as the Metadata it stands for
        return Metadata

    def __reduce__(self):
        return (Metadata, tuple(getattr(self, f.name) for f in dataclasses.fields(Metadata)))


def lazy_metadata(raw: bytes, where: str) -> EncodedMetadata:
    """A Metadata for the document ``raw``: its checksum is verified now, the rest is decoded when first used."""
    return EncodedMetadata(raw, where)


def parse_metadata(raw: bytes, where: str) -> Metadata:
    """Validate and decode a metadata document. Every failure is a typed CheckpointError.

    The cyclic garbage collector is paused meanwhile: the document becomes many
    small objects without cycles, and collections they trigger would cost more
    than the decoding (docs/performance.md).
    """
    try:
        with gc_paused():
            return _parse_metadata(raw, where)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as exc:
        # the explicit checks above cover the format; this keeps the contract for shapes they did not foresee
        raise CorruptCheckpointError(f"{where}: malformed metadata ({type(exc).__name__}: {exc})") from None


def check_document(raw: bytes, where: str) -> None:
    """Raise CorruptCheckpointError unless ``raw`` ends with the CRC-32C of everything before its checksum member."""
    m = _TRAILER.search(raw)
    if m is None:
        raise CorruptCheckpointError(f"{where}: metadata does not end with its checksum; the file is truncated or not a "
                                     "distckpt metadata file")
    want = int(m.group(1), 16)
    got = crc32c(raw[: m.start()])
    if got != want:
        raise CorruptCheckpointError(f"{where}: metadata checksum mismatch (stored {want:08x}, computed {got:08x}); the file "
                                     "is damaged, restore it from a copy")


_INT = {int}
_new = object.__new__
_ORIGINS = [torch.Size([0] * n) for n in range(65)]


def _whole_tensor(entry: Any, fqn: str, locations: Any) -> Optional[TensorStorageMetadata]:
    """A format-2.x tensor entry of one chunk as large as the tensor, stored as it is, with its location added to
    ``locations``; or None where the entry is anything else or breaks a rule (the general path then decodes it and
    names the fault). The checks are those of the general path, fused: most entries of a many-tensor document are
    of this form, and this is most of what decoding it costs."""
    if type(entry) is not dict or len(entry) != 4 or entry.get("type") != "tensor":
        return None
    size_raw, props_raw, chunks_raw = entry.get("size"), entry.get("properties"), entry.get("chunks")
    if type(size_raw) is not list or type(props_raw) is not list or type(chunks_raw) is not list or len(chunks_raw) != 1:
        return None
    c = chunks_raw[0]
    if type(c) is not list or len(c) != 5 or len(size_raw) > 64 or fqn in locations.keys_ or fqn in locations.whole_:
        return None
    o_raw, s_raw, file_no, begin, crc = c
    if type(o_raw) is not list or s_raw != size_raw or o_raw != [0] * len(size_raw) or set(map(type, size_raw + s_raw + o_raw)) - _INT:
        return None  # (equal lists may still differ in type: 1.0 == 1 == True)
    try:
        fields = DECODED_PROPS.get(tuple(props_raw))
    except TypeError:
        return None
    if fields is None or type(file_no) is not int or type(begin) is not int or type(crc) is not int:
        return None
    nbytes = itemsize(fields[0])
    for n in size_raw:
        if n < 0 or n > _MAX_INT:
            return None
        nbytes *= n
    if not (0 <= file_no < len(locations.file_sizes) and 0 <= begin and begin + nbytes <= locations.file_sizes[file_no]
            and 0 <= crc <= 0xFFFFFFFF):
        return None
    size = torch.Size(size_raw)
    chunk = _new(ChunkStorageMetadata)
    chunk.offsets = _ORIGINS[len(size_raw)]  # a Size is immutable: one per dimension count serves every chunk
    chunk.sizes = size
    locations.keys_[fqn] = (len(locations.begin), {chunk.offsets: 0})
    locations.file_no.append(file_no)
    locations.begin.append(begin)
    locations.length.append(nbytes)
    locations.crc.append(crc)
    return TensorStorageMetadata(TensorProperties(*fields), size, [chunk])


def _storage_meta(data: Any, where: str) -> Optional[StorageMeta]:
    """``storage_meta``: null, or an object whose ids are strings or null and whose ``modules`` is a list of strings
    (what :func:`metadata_document` writes; a number or a list there would reach planners, and the next save)."""
    if data is None:
        return None
    ids = [data.get(name) for name in ("checkpoint_id", "save_id", "load_id")] if type(data) is dict else []
    modules = data.get("modules") if type(data) is dict else None
    if (type(data) is not dict or not all(x is None or type(x) is str for x in ids)
            or not (modules is None or (type(modules) is list and all(type(m) is str for m in modules)))):
        raise CorruptCheckpointError(f"{where}: malformed storage_meta {data!r:.200} (its ids are strings or null, its modules "
                                     "a list of strings); the file is damaged or was not written by distckpt")
    return StorageMeta(*ids, list(modules or []))


def _parse_metadata(raw: bytes, where: str) -> Metadata:
    """The steps of :func:`parse_metadata`: the document's frame, its file table, its entries, the Metadata."""
    body, version, major = _document_body(raw, where)
    sdm_raw = body["state_dict_metadata"]
    storage_raw = body.get("storage_data")
    fsd = _inline_file_table(storage_raw, version, major, where)
    locations = fsd.items if fsd is not None else None
    table = _tensor_table(body, major, fsd, len(sdm_raw), where)
    sdm: dict = {}
    total_chunks = len(table) if table is not None else 0
    for fqn, entry in sdm_raw.items():
        if fsd is not None:  # the common entry, one chunk as large as the tensor, checked and built in one go
            tensor = _whole_tensor(entry, fqn, locations)
            if tensor is not None:
                sdm[fqn] = tensor
                total_chunks += 1
                continue
        sdm[fqn], total_chunks = _entry(fqn, entry, locations, total_chunks, where)
    if table is not None:  # entries of the table's keys are built when asked for
        sdm = TableEntries(table, sdm)
    return _assemble(body, version, sdm, fsd, storage_raw, where)


def _inline_file_table(storage_raw: Any, version: str, major: int, where: str) -> Optional[FileStorageData]:
    """The data-file table of a format-2.x-or-later document (its ``storage_data`` is ``{"$files": ...}``), checked;
    None for any other storage data (format 1.x keeps its table apart, another storage layer its own data)."""
    if not (major >= 2 and isinstance(storage_raw, dict) and set(storage_raw) == {"$files"}):
        return None
    fsd = decode_file_table(storage_raw["$files"], where)
    if major < 4 and any(info.save_id is not None for info in fsd.files.values()):
        raise CorruptCheckpointError(f"{where}: a format-{version} document lists a data file of another checkpoint, which "
                                     "only format 4.0 records; the metadata is damaged or hostile")
    return fsd


def _document_body(raw: bytes, where: str) -> tuple[dict, str, int]:
    """The checked document's top-level object, its format version and that version's major number."""
    check_document(raw, where)
    body = loads(raw[:-1], where)
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a distckpt metadata document")
    version = body.get("format_version")
    if not isinstance(version, str) or not re.fullmatch(r"\d{1,4}\.\d{1,4}", version):
        raise CorruptCheckpointError(f"{where}: malformed format_version {version!r:.40}")
    major = int(version.split(".")[0])
    if major not in SUPPORTED_MAJORS:
        readable = ", ".join(f"{v}.x" for v in SUPPORTED_MAJORS)
        raise FormatVersionError(
            f"{where}: written in format version {version}; this distckpt reads format versions {readable}. "
            "Use a distckpt release that supports that version."
        )
    sdm_raw = body.get("state_dict_metadata")
    if not isinstance(sdm_raw, dict):
        raise CorruptCheckpointError(f"{where}: state_dict_metadata is missing or not an object")
    if len(sdm_raw) > MAX_KEYS:
        raise CorruptCheckpointError(f"{where}: more than {MAX_KEYS} keys")
    return body, version, major


def _tensor_table(body: dict, major: int, fsd: Optional[FileStorageData], entries: int, where: str) -> Any:
    """The table of whole tensors of a format-3 document (None where it has none), its locations added to ``fsd``'s."""
    if not (major >= 3 and "tensors" in body):
        return None
    if fsd is None:
        raise CorruptCheckpointError(f"{where}: a tensors table needs distckpt's data-file table as storage_data")
    table = decode_table(body["tensors"], where, fsd.items)
    if len(table) + entries > MAX_KEYS:
        raise CorruptCheckpointError(f"{where}: more than {MAX_KEYS} keys")
    return table


def _entry(fqn: str, entry: Any, locations: Any, total_chunks: int, where: str) -> tuple[Any, int]:
    """One entry of ``state_dict_metadata`` by the general path, its locations added to ``locations`` (None where the
    document keeps them apart, format 1.x); and the count of chunks so far, this entry's included."""
    here = f"{where}: key {fqn!r}"
    if not isinstance(entry, dict) or entry.get("type") not in ("tensor", "bytes"):
        raise CorruptCheckpointError(f"{here}: malformed entry")
    if entry["type"] == "bytes":
        if locations is not None:
            at = entry.get("at")
            if not isinstance(at, list) or len(at) not in (4, 5):
                raise CorruptCheckpointError(f"{here}: value has no valid location")
            codec = stored_codec(at[4], False, here)[0] if len(at) == 5 else None
            add_item(locations, fqn, None, at[0], at[1], at[2], at[3], here, codec)
        return BytesStorageMetadata(), total_chunks
    size = _ints(entry.get("size"), here)
    props = dec_props(entry.get("properties"), here)
    chunks_raw = entry.get("chunks")
    if not isinstance(chunks_raw, list):
        raise CorruptCheckpointError(f"{here}: chunks must be a list")
    total_chunks += len(chunks_raw)
    if total_chunks > MAX_CHUNKS:
        raise CorruptCheckpointError(f"{where}: more than {MAX_CHUNKS} chunks")
    width = itemsize(props.dtype)
    if locations is None:
        chunks = [checked_chunk(dec_chunk(c, here), size, here) for c in chunks_raw]
        check_cover(chunks, size, here)
    else:
        chunks = inline_chunks(chunks_raw, fqn, size, width, locations, here)  # checks the cover too
    return TensorStorageMetadata(props, size, chunks), total_chunks


def _assemble(body: dict, version: str, sdm: Any, fsd: Optional[FileStorageData], storage_raw: Any, where: str) -> Metadata:
    """The Metadata of the decoded entries, with the document's storage, planner data and storage_meta; locations
    checked for overlaps (inline, 2.x) or against the entries one to one (1.x)."""
    sm = _storage_meta(body.get("storage_meta"), where)
    if fsd is not None:
        storage_data: Any = fsd
        fsd.items.check_no_overlap(where)
    else:
        storage_data = opaque_from(storage_raw, f"{where}: storage_data", False)
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=opaque_from(body.get("planner_data"), f"{where}: planner_data", False),
        storage_data=storage_data,
        storage_meta=sm,
        version=version,
    )
    if isinstance(md.storage_data, FileStorageData) and fsd is None:
        # format 1.x lists locations apart from the entries: check they match one to one.
        # In 2.x each location sits in its chunk, with the length the chunk implies.
        cross_check(md, md.storage_data, where)
    return md
