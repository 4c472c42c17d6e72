"""The JSON codecs of plans and write results: what the save and load sequences send between ranks.

Never pickle: values the protocol leaves opaque go through the same tagged
data as the metadata document (``format.codec.opaque_to``), and pickled
objects only where ``DISTCKPT_ALLOW_PICKLE_TRANSPORT`` allows them.
"""

from __future__ import annotations

import torch

from ..format.chunk_codec import IDENTITY
from ..format.codec import dec_chunk, dec_index, dec_props, enc_chunk, enc_index, enc_props, opaque_from, opaque_to
from ..format.records import FileInfo, FileResult, StorageInfo
from ..planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from ..storage import WriteResult

__all__ = ["encode_save_plan", "decode_save_plan", "encode_load_plan", "decode_load_plan", "encode_write_results",
           "decode_write_results"]


def encode_save_plan(plan: SavePlan) -> dict:
    items = []
    for it in plan.items:
        td = it.tensor_data
        items.append([
            enc_index(it.index),
            it.type.value,
            None if it.bytes_io_data is None else it.bytes_io_data.nbytes,
            None if td is None else [enc_chunk(td.chunk), enc_props(td.properties), list(td.size)],
        ])
    return {"items": items, "storage_data": opaque_to(plan.storage_data, "plan storage_data", True),
            "planner_data": opaque_to(plan.planner_data, "plan planner_data", True), "usable": plan.usable}


def decode_save_plan(data: dict) -> SavePlan:
    items = []
    for idx, typ, nbytes, td in data["items"]:
        tensor_data = None if td is None else TensorWriteData(dec_chunk(td[0], "plan"), dec_props(td[1], "plan"), torch.Size(td[2]))
        items.append(WriteItem(dec_index(idx, "plan"), WriteItemType(typ),
                               None if nbytes is None else BytesIOWriteData(nbytes), tensor_data))
    return SavePlan(items, opaque_from(data["storage_data"], "plan", True),
                    opaque_from(data["planner_data"], "plan", True), data["usable"])


def encode_load_plan(plan: LoadPlan) -> dict:
    items = [[it.type.value, enc_index(it.dest_index), list(it.dest_offsets), enc_index(it.storage_index),
              list(it.storage_offsets), list(it.lengths)] for it in plan.items]
    return {"items": items, "storage_data": opaque_to(plan.storage_data, "plan storage_data", True),
            "planner_data": opaque_to(plan.planner_data, "plan planner_data", True)}


def decode_load_plan(data: dict) -> LoadPlan:
    items = [ReadItem(LoadItemType(t), dec_index(d, "plan"), torch.Size(do), dec_index(s, "plan"), torch.Size(so), torch.Size(ln))
             for t, d, do, s, so, ln in data["items"]]
    return LoadPlan(items, opaque_from(data["storage_data"], "plan", True), opaque_from(data["planner_data"], "plan", True))


def encode_write_results(results: list[WriteResult]) -> list:
    out = []
    for r in results:
        sd = r.storage_data
        if isinstance(r, FileResult):
            out.append([{"$file": r.file}, r.size_in_bytes, {"$fi": [sd.size, sd.rank, sd.header_crc32c]}])
            continue
        if isinstance(sd, StorageInfo):
            sd = {"$si": [sd.file, sd.offset, sd.length, sd.crc32c] + ([] if sd.codec == IDENTITY.name else [sd.codec])}
        elif isinstance(sd, FileInfo):
            sd = {"$fi": [sd.size, sd.rank, sd.header_crc32c]}
        else:
            sd = opaque_to(sd, "write result", True)
        out.append([enc_index(r.index), r.size_in_bytes, sd])
    return out


def decode_write_results(data: list) -> list[WriteResult]:
    out = []
    for idx, size, sd in data:
        if isinstance(idx, dict) and set(idx) == {"$file"} and isinstance(sd, dict) and set(sd) == {"$fi"}:
            out.append(FileResult.of(str(idx["$file"]), FileInfo(*sd["$fi"])))
            continue
        if isinstance(sd, dict) and "$si" in sd and len(sd) == 1:
            sd = StorageInfo(*sd["$si"])
        elif isinstance(sd, dict) and "$fi" in sd and len(sd) == 1:
            sd = FileInfo(*sd["$fi"])
        else:
            sd = opaque_from(sd, "write result", True)
        out.append(WriteResult(dec_index(idx, "write result"), size, sd))
    return out
