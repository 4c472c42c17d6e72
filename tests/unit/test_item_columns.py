"""The columnar save path (WriteColumns items, bulk resolve, column results) against the protocol's object path."""

import copy

import pytest
import torch

import distckpt
from distckpt import DefaultSavePlanner
from distckpt.backends.filesystem import FileSystemReader
from distckpt.item_columns import WriteColumns
from distckpt.planner import WriteItem


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(33, 7, generator=g),
        "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "i64": torch.arange(11),
        "flag": torch.tensor([True, False, True]),
        "cplx": torch.randn(4, generator=g, dtype=torch.complex64),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "grad": torch.randn(3, generator=g, requires_grad=True),
        "step": 17,
        "nested": {"lr": 0.1, "name": "adam"},
    }


class _ObjectPath(DefaultSavePlanner):
    """Overrides transform_object without declaring resolves_columns: the writer must call resolve_data per item."""

    calls = 0

    def transform_object(self, write_item, obj):
        type(self).calls += 1
        return super().transform_object(write_item, obj)


class _HalfPlanner(DefaultSavePlanner):
    """The protocol's fp16 pattern: rewrite the dtype of the local plan's float items in place."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        for item in plan.items:
            if item.tensor_data is not None and item.tensor_data.properties.dtype == torch.float32:
                item.tensor_data.properties.dtype = torch.float16
        return plan


def _locations(path):
    md = FileSystemReader(path).read_metadata()
    return md, {ix: (si.length, si.crc32c) for ix, si in md.storage_data.items.items()}


def _blank(sd):
    out = {}
    for k, v in sd.items():
        out[k] = torch.zeros_like(v).detach() if isinstance(v, torch.Tensor) else (dict(v) if isinstance(v, dict) else v)
    return out


def test_columns_and_objects_store_the_same_items_of_every_dtype(tmp_path):
    sd = _state()
    distckpt.save(sd, checkpoint_id=tmp_path / "cols")
    _ObjectPath.calls = 0
    distckpt.save(sd, checkpoint_id=tmp_path / "objs", planner=_ObjectPath())
    assert _ObjectPath.calls == 9  # one per tensor: the object path ran there
    md_c, loc_c = _locations(tmp_path / "cols")
    md_o, loc_o = _locations(tmp_path / "objs")
    assert md_c.state_dict_metadata == md_o.state_dict_metadata and md_c.planner_data == md_o.planner_data
    assert loc_c == loc_o  # the same lengths and checksums, item for item
    for name in ("cols", "objs"):
        dest = _blank(sd)
        distckpt.load(dest, checkpoint_id=tmp_path / name)
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                got, want = dest[k].reshape(-1).view(torch.uint8), v.detach().reshape(-1).view(torch.uint8)
                assert dest[k].dtype == v.dtype and torch.equal(got, want), k
        assert dest["step"] == 17 and dest["nested"] == {"lr": 0.1, "name": "adam"}
    assert distckpt.verify(tmp_path / "cols").ok


def test_a_planner_that_changes_its_items_in_place_is_saved_as_changed(tmp_path):
    sd = {"w": torch.randn(8, 8), "ids": torch.arange(4)}
    distckpt.save(sd, checkpoint_id=tmp_path / "ck", planner=_HalfPlanner())
    md = FileSystemReader(tmp_path / "ck").read_metadata()
    assert md.state_dict_metadata["w"].properties.dtype == torch.float16
    assert md.state_dict_metadata["ids"].properties.dtype == torch.int64
    dest = {"w": torch.zeros(8, 8, dtype=torch.float16), "ids": torch.zeros(4, dtype=torch.int64)}
    distckpt.load(dest, checkpoint_id=tmp_path / "ck")
    assert torch.equal(dest["w"], sd["w"].half()) and torch.equal(dest["ids"], sd["ids"])


def test_write_columns_build_items_only_when_read_and_then_give_up_the_columns():
    planner = DefaultSavePlanner()
    planner.set_up_planner({"a": torch.ones(2, 3), "b": 5}, None, True)
    plan = planner.create_local_plan()
    cols = plan.items
    assert isinstance(cols, WriteColumns) and cols.intact and len(cols) == 2 and cols.intact
    again = DefaultSavePlanner()
    again.set_up_planner({"a": torch.ones(2, 3), "b": 5}, None, True)
    assert again.create_local_plan().items == cols and cols.intact  # compared column-wise
    assert cols.select([False, True]).fqn == ["b"] and cols.select([True, True]) is cols
    copied = copy.deepcopy(plan)
    assert isinstance(copied.items, list) and all(isinstance(i, WriteItem) for i in copied.items)
    first = cols[0]
    assert not cols.intact and first.index.fqn == "a" and list(first.tensor_data.size) == [2, 3]
    assert cols == copied.items and cols + [] == copied.items
    with pytest.raises(ValueError):
        cols.select([True, False])
    cols.append(first)
    assert len(cols) == 3


def test_a_damaged_item_inside_a_batch_is_named_alone_across_two_files(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTCKPT_IO_THREADS", "2")
    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", "4096")  # two data files, each written by its own thread
    dtypes = [torch.float32, torch.bfloat16, torch.int32, torch.float64, torch.uint8]
    g = torch.Generator().manual_seed(5)
    sd = {f"p{i}": torch.randint(0, 100, (64 + i,), generator=g).to(dtypes[i % len(dtypes)]) for i in range(300)}
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    md = FileSystemReader(tmp_path / "ck").read_metadata()
    files = sorted(md.storage_data.files)
    assert len(files) == 2
    in_second = sorted((si.offset, ix.fqn, si) for ix, si in md.storage_data.items.items() if si.file == files[1])
    _, victim, si = in_second[len(in_second) // 2]  # one item in the middle of a batch of the second file
    with open(tmp_path / "ck" / si.file, "r+b") as f:
        f.seek(si.offset + si.length // 2)
        byte = f.read(1)
        f.seek(si.offset + si.length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(distckpt.CorruptCheckpointError) as info:
        distckpt.load(dest, checkpoint_id=tmp_path / "ck")
    named = [k for k in sd if f"'{k}'" in str(info.value)]
    assert named == [victim], str(info.value)
    with pytest.raises(distckpt.CorruptCheckpointError, match=f"key '{victim}'"):
        distckpt.verify(tmp_path / "ck")


def test_a_writer_that_does_not_commit_columns_gets_the_items_as_objects(tmp_path):
    from distckpt import FileSystemWriter

    class _ObjectWriter(FileSystemWriter):
        capabilities = frozenset()  # no COLUMNAR_COMMIT: global planning and commit on objects

        def write_data(self, plan, planner):
            assert not (isinstance(plan.items, WriteColumns) and plan.items.intact)
            return super().write_data(plan, planner)

    sd = _state()
    distckpt.save(sd, storage_writer=_ObjectWriter(tmp_path / "ck"))
    distckpt.save(sd, checkpoint_id=tmp_path / "cols")
    assert _locations(tmp_path / "ck")[1] == _locations(tmp_path / "cols")[1]
    dest = _blank(sd)
    distckpt.load(dest, checkpoint_id=tmp_path / "ck")
    assert torch.equal(dest["f32"], sd["f32"]) and dest["nested"] == {"lr": 0.1, "name": "adam"}


class _ObjectLoad(distckpt.DefaultLoadPlanner):
    """Overrides resolve_tensor without declaring resolves_columns: the reader must ask it per item."""

    calls = 0

    def resolve_tensor(self, read_item):
        type(self).calls += 1
        return super().resolve_tensor(read_item)


def test_loads_from_columns_and_from_objects_fill_the_same_bytes(tmp_path):
    sd = _state()
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    dest_c, dest_o = _blank(sd), _blank(sd)
    distckpt.load(dest_c, checkpoint_id=tmp_path / "ck")
    _ObjectLoad.calls = 0
    distckpt.load(dest_o, checkpoint_id=tmp_path / "ck", planner=_ObjectLoad())
    assert _ObjectLoad.calls == 9
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(dest_c[k].reshape(-1).view(torch.uint8), dest_o[k].reshape(-1).view(torch.uint8)), k
            assert torch.equal(dest_c[k].reshape(-1).view(torch.uint8), v.detach().reshape(-1).view(torch.uint8)), k
    assert dest_c["nested"] == dest_o["nested"] == {"lr": 0.1, "name": "adam"}


def test_a_whole_chunk_into_another_dtype_or_a_strided_destination_goes_through_a_buffer(tmp_path):
    sd = {"w": torch.randn(6, 4), "b": torch.arange(5, dtype=torch.int32)}
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    strided = torch.zeros(4, 6).t()  # not contiguous: no byte view to read into
    dest = {"w": strided, "b": torch.zeros(5, dtype=torch.int64)}
    distckpt.load(dest, checkpoint_id=tmp_path / "ck", planner=distckpt.DefaultLoadPlanner(allow_dtype_conversion=True))
    assert torch.equal(dest["w"], sd["w"]) and torch.equal(dest["b"], sd["b"].long())


def test_read_columns_build_items_only_when_read():
    from distckpt.item_columns import ReadColumns
    from distckpt.metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata

    sd = {"a": torch.ones(2, 3), "n": 4}
    planner = distckpt.DefaultLoadPlanner()
    chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))
    md = Metadata({"a": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([2, 3]), [chunk]),
                   "n": BytesStorageMetadata()})
    planner.set_up_planner(sd, md, True)
    cols = planner.create_local_plan().items
    assert isinstance(cols, ReadColumns) and cols.intact and len(cols) == 2 and cols.intact
    a = cols.column_item(0)
    assert cols.intact and a.dest_index.fqn == "a" and list(a.lengths) == [2, 3] and a.storage_index.index == 0
    assert planner.resolve_tensor(a) is cols.dest[0]
    assert [i.dest_index.fqn for i in cols] == ["a", "n"] and not cols.intact
    assert copy.deepcopy(cols) == list(cols)


def test_rows_and_headers_written_as_text_are_what_json_dumps_gives():
    """The metadata rows and data-file headers are written as text for speed; they must stay the JSON a dict gives."""
    from distckpt.format.codec import dumps, tensor_row
    from distckpt.format.datafile import Entry, _lead, build_header, header_json
    from distckpt.format.tensor_table import TableWriter

    props = ["float32", "strided", False, "contiguous", False]
    for chunks in ([[[0], [5], 1, 4096, 7]], [[[0, 0], [2, 3], 0, 0, 1], [[2, 0], [2, 3], 0, 24, 2]], [[[], [], 0, 8, 0]],
                   [[[0], [5]]], [[[0], [5], 1, 64, 9, {"codec": ["zstd"], "length": 3}]]):
        size = [len(chunks) * c for c in chunks[0][1]] if chunks[0][1] else []
        want = dumps({"type": "tensor", "size": size, "properties": props,
                      "chunks": [list(c[:2]) + list(c[2:]) for c in chunks]}).decode()
        assert tensor_row(size, props, chunks) == want
    table = TableWriter()
    for i, size in enumerate(([5], [2, 3], [], [0, 4], [1, 1, 1, 7])):  # the table of whole tensors
        table.add(f'k\u00e9"\\{i}', size, props if i % 2 else props[:2] + [True] + props[3:], i % 2, 4096 * i, 4294967295 - i)
    want = dumps({"tensors": {"keys": [f'k\u00e9"\\{i}' for i in range(5)],
                              "properties": [props[:2] + [True] + props[3:], props], "property": [0, 1, 0, 1, 0],
                              "ndim": [1, 2, 0, 2, 4], "size": [5, 2, 3, 0, 4, 1, 1, 1, 7], "file": [0, 1, 0, 1, 0],
                              "offset": [0, 4096, 8192, 12288, 16384], "crc32c": [4294967295 - i for i in range(5)]}})
    assert b"{" + table.member(dumps) + b"}" == want
    entries = [Entry("a", "F32", (3,), 12), Entry('b\u00e9"\\\n@0,1', "BF16", (2, 3), 12), Entry("c", "U8", (), 1),
               Entry("d", "F64", (0, 4), 0), Entry("\x00x\u2028", "I64", (1, 1, 1), 8)]
    meta = {"format": "distckpt", "format_version": "2.0", "save_id": "s", "rank": "3"}
    assert build_header(entries, "s", 3) == _lead(header_json(entries, meta), entries)
    clash = entries + [Entry("__metadata__", "U8", (4,), 4)]  # an item named like the file's metadata replaces it
    assert build_header(clash, "s", 3) == _lead(header_json(clash, meta), clash)


def test_a_save_through_zstd_stays_on_columns_from_plan_to_commit(tmp_path, monkeypatch):
    from distckpt.engine import commit
    from distckpt.item_columns import PlanColumns, ResultColumns
    from distckpt.planning import save_planner

    def fell_back(*args, **kwargs):
        raise AssertionError("the zstd save left the columnar path")

    for owner, name in ((WriteColumns, "build"), (PlanColumns, "to_plan"), (ResultColumns, "to_results"),
                        (save_planner, "build_metadata"), (commit, "encode_metadata")):
        monkeypatch.setattr(owner, name, fell_back)
    sd = _state()
    writer = distckpt.FileSystemWriter(tmp_path / "ck", _extensions=[distckpt.ZStandard()])
    distckpt.save(sd, storage_writer=writer)
    monkeypatch.undo()
    md = distckpt.read_metadata(tmp_path / "ck")
    assert md.version == "2.1"
    assert {si.codec for si in md.storage_data.items.values()} == {"stream.zstd/1"}
    dest = _blank(sd)
    distckpt.load(dest, checkpoint_id=tmp_path / "ck")
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(dest[k].reshape(-1).view(torch.uint8), v.detach().reshape(-1).view(torch.uint8)), k
    assert dest["nested"] == {"lr": 0.1, "name": "adam"} and dest["step"] == 17
    # the same checkpoint as the object path writes, chunk for chunk
    distckpt.save(sd, storage_writer=distckpt.FileSystemWriter(tmp_path / "objects", _extensions=[distckpt.ZStandard()]),
                  planner=_ObjectPath())
    want = distckpt.read_metadata(tmp_path / "objects")
    assert md.state_dict_metadata == want.state_dict_metadata
    assert {k: (v.length, v.crc32c, v.codec) for k, v in md.storage_data.items.items()} == \
        {k: (v.length, v.crc32c, v.codec) for k, v in want.storage_data.items.items()}
