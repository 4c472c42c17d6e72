"""A save's commit: the metadata document built from what the ranks wrote, checked, and published last.

Both planning paths end here. From the columnar plan and the ranks' result
columns (:func:`columns_document`) or from the Metadata of the object path
and the ranks' WriteResults (:func:`objects_document`), the same three
things happen side by side: the data-file table is gathered from the
results, every tensor's chunks are checked to cover it exactly (the columnar
planner declines plans that do not; the object path checks here, whatever
planner made the metadata), and the document is encoded with one row writer
(``format/codec.py``). :func:`publish` then checks that every data file the
document lists is stored whole, and commits it.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError
from ..format import METADATA_FILE
from ..format.chunk_codec import DECODED_CRC, IDENTITY
from ..format.codec import (
    bytes_row,
    codec_record,
    encode_metadata,
    file_table,
    metadata_document,
    quote,
    stored_files,
    tensor_row,
    written_version,
)
from ..format.locations import check_cover, checked_chunk
from ..format.records import FileResult, FileStorageData, StorageInfo
from ..format.tensor_table import TableWriter
from ..item_columns import BYTES, ResultColumns
from ..metadata import Metadata, StorageMeta, TensorStorageMetadata
from ..planning.columnar import ColumnarPlan
from ..storage import WriteResult
from .blobs import BlobStore
from .references import check_references

__all__ = ["columns_document", "objects_document", "publish"]


def objects_document(metadata: Metadata, results: list[list[WriteResult]], save_id: str, checkpoint_id: str) -> bytes:
    """The metadata document of a save planned on objects; fills in ``metadata``'s storage data, storage meta
    and version to match it."""
    fsd = FileStorageData(save_id=save_id)
    for rank_results in results:
        for r in rank_results:
            if isinstance(r, FileResult):
                fsd.files[r.file] = r.storage_data
            elif isinstance(r.storage_data, StorageInfo):
                fsd.items[r.index] = r.storage_data
    for fqn, entry in metadata.state_dict_metadata.items():  # whatever planner made it: never commit a gap
        if isinstance(entry, TensorStorageMetadata):
            for c in entry.chunks:
                checked_chunk(c, entry.size, f"checkpoint {checkpoint_id!r}: key {fqn!r}")
            check_cover(entry.chunks, entry.size, f"checkpoint {checkpoint_id!r}: key {fqn!r}")
    metadata.storage_data = fsd
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.checkpoint_id = checkpoint_id
    metadata.storage_meta.save_id = save_id
    document = encode_metadata(metadata)
    metadata.version = written_version(document)
    return document


class _Stored:
    """Where each item of the ranks' result columns landed, as flat arrays over the ranks' items in plan order."""

    def __init__(self, plan: ColumnarPlan, results: list[ResultColumns]) -> None:
        if len(results) != len(plan.keep):
            raise CorruptCheckpointError(f"write results from {len(results)} ranks for a plan of {len(plan.keep)}; nothing was committed")
        files: dict[str, list] = {}
        codecs: dict[str, int] = {IDENTITY.name: 0}
        rank_files, codec_nos = [], []
        for r, res in enumerate(results):
            if len(res.file_no) != int(plan.keep[r].sum()):
                raise CorruptCheckpointError(f"rank {r} reported {len(res.file_no)} written items, its plan had {int(plan.keep[r].sum())}; "
                                             "nothing was committed")
            for f in res.files:
                if f[0] in files and (len(f) < 5 or files[f[0]] != f):  # a file of an earlier save may be referenced twice
                    raise CorruptCheckpointError(f"data file {f[0]!r} was written by two ranks; nothing was committed")
                files[f[0]] = f
            rank_files.append(res.files)
            codec_nos.append(np.array([codecs.setdefault(name, len(codecs)) for name in res.codecs], dtype=np.int64))
        self.names = sorted(files)
        self.files = files
        self.codecs = list(codecs)
        number = {name: i for i, name in enumerate(self.names)}
        empty = np.zeros(0, np.int64)
        self.file_no = np.concatenate([np.array([number[f[0]] for f in fs], dtype=np.int64)[res.file_no] if len(fs) else empty
                                       for fs, res in zip(rank_files, results)] + [empty])
        self.codec = np.concatenate([nos[res.codec_column()] if len(res.file_no) else empty
                                     for nos, res in zip(codec_nos, results)] + [empty])
        self.begin = np.concatenate([res.offset for res in results] + [empty])
        self.length = np.concatenate([res.length for res in results] + [empty])
        self.crc = np.concatenate([res.crc for res in results] + [empty])
        self.base = np.cumsum([0] + [len(res.file_no) for res in results])


def columns_document(plan: ColumnarPlan, results: list[ResultColumns], save_id: str, checkpoint_id: Optional[str]) -> bytes:
    """The metadata document of a save planned on columns, built from the arrays (format 2.x)."""
    stored = _Stored(plan, results)
    row = stored.base[plan.group_rank] + plan.group_ordinal
    codec = stored.codec[row]
    as_is = plan.code[plan.group_gid] != BYTES
    as_is &= codec == 0  # a chunk stored through a codec has its own length
    if (stored.length[row][as_is] != plan.group_bytes[as_is]).any():
        raise CorruptCheckpointError("a rank wrote a chunk with a length other than planned; nothing was committed")
    f_l, b_l, c_l, len_l = stored.file_no[row].tolist(), stored.begin[row].tolist(), stored.crc[row].tolist(), stored.length[row].tolist()
    coded = bool(codec.any())
    codec_l = codec.tolist() if coded else None
    offs, sizes = plan.chunk_rows()
    lo, hi = plan.key_ranges()
    members: list[str] = []
    table = TableWriter()
    for g, a, b in zip(plan.key_order.tolist(), lo[plan.key_order].tolist(), hi[plan.key_order].tolist()):
        fqn, code, props, gsize, _ = plan.rows[g]
        if code == BYTES:
            record = (codec_record(stored.codecs[codec_l[a]], len_l[a], False),) if coded and codec_l[a] else ()
            members.append(f"{quote(fqn)}:{bytes_row((f_l[a], b_l[a], len_l[a], c_l[a], *record))}")
            continue
        if b - a == 1 and sizes[a] == gsize and len(gsize) <= 64 and not any(offs[a]) and not (coded and codec_l[a]):
            table.add(fqn, gsize, props, f_l[a], b_l[a], c_l[a])  # one chunk, stored as it is: the whole tensor
            continue
        chunks = list(zip(offs[a:b], sizes[a:b], f_l[a:b], b_l[a:b], c_l[a:b]))
        if coded:
            chunks = [c + ((codec_record(stored.codecs[n], ln, True),) if n else ())
                      for c, n, ln in zip(chunks, codec_l[a:b], len_l[a:b])]
        members.append(f"{quote(fqn)}:{tensor_row(gsize, props, chunks)}")
    storage = file_table(save_id, [stored.files[n] for n in stored.names])
    return metadata_document(members, storage, plan.planner_json(), StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
                             coded, table=table, v4=any(len(f) > 4 for f in stored.files.values())
                             or any(DECODED_CRC in name for name in stored.codecs))


def publish(store: BlobStore, save_id: str, document: bytes, replaces: bool, sync: bool, checkpoint_id: str) -> None:
    """Write the metadata document of save ``save_id`` and commit the checkpoint (coordinator).

    The data files the document lists are checked first, by name and size: a commit never publishes
    metadata whose files are missing, whatever else ran on the storage meanwhile.
    """
    staging = store.staging(save_id)
    found = staging.sizes()
    listed = stored_files(document, f"the metadata of checkpoint {checkpoint_id!r}")
    if listed is None or listed.save_id != save_id:
        raise CorruptCheckpointError(f"the metadata built for checkpoint {checkpoint_id!r} does not list the data files of "
                                     f"save {save_id}; nothing was committed")
    for name, size in listed.own.items():
        if found.get(name) != size:
            raise CorruptCheckpointError(
                f"{staging.describe(name)} is {'missing' if name not in found else f'{found[name]} bytes, not {size}'} "
                f"just before commit of checkpoint {checkpoint_id!r}; something else removed or changed this "
                "save's files. Nothing was committed: save again.")
    check_references(store, listed, f"checkpoint {checkpoint_id!r}")
    staging.put_atomic(METADATA_FILE, document, sync)
    store.commit(staging, replaces, sync)
    if listed.references:
        _withdraw_if_broken(store, listed, checkpoint_id)


def _withdraw_if_broken(store: BlobStore, listed: Any, checkpoint_id: str) -> None:
    """Check the references of a document just committed again: another process's retention or overwrite may have
    deleted a file it references after the check before the commit (its mark phase could not see this document).
    A step so broken is withdrawn, not left committed, and the save fails: the next save writes every chunk."""
    try:
        check_references(store, listed, f"checkpoint {checkpoint_id!r}")
        return
    except CorruptCheckpointError as exc:
        reason = str(exc).split(";")[0]  # which file, without the advice for a save that did not commit
    try:
        store.remove()
        withdrawn = "it was withdrawn"
    except CheckpointError as exc:
        withdrawn = f"withdrawing it failed too ({exc}): remove it"
    raise CorruptCheckpointError(
        f"checkpoint {checkpoint_id!r} committed, but a file it references was deleted meanwhile by another process "
        f"(retention or an overwrite of that step): {reason}; {withdrawn}. Save again.")
