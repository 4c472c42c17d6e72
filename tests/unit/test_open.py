"""distckpt.open: a checkpoint as a read-only mapping of lazily read tensors and values, with no process group.
A slice reads only its rows' bytes, from chunks of any sharding, bit-exact against a full load; chunks read
whole are checksummed; codecs and other programs' layouts read through the same checks."""

import os
import random
import warnings

import pytest
import torch

import distckpt
from distckpt import CorruptCheckpointError
from distckpt.backends import BlobStorageReader, BlobStore
from distckpt.backends.filesystem import FsStore
from distckpt.engine.blobs import BlobReader
from distckpt.errors import CheckpointClosedError, CheckpointIndexError, MissingKeyError
from distckpt.metadata import MetadataIndex
from distckpt.planning.slices import row_blocks, row_runs, select
from distckpt.testing.read_counts import FileReads

from . import open_workers


class CountingStore(BlobStore):
    """A store that logs every read of its blobs: (name, offset, length)."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def open(self, name):
        return _CountingReader(self.inner.open(name), name, self.log)

    def data_store(self, save_id):
        return CountingStore(self.inner.data_store(save_id), self.log)

    def create(self, name, buffer_bytes=None):
        return self.inner.create(name, buffer_bytes)

    def list(self):
        return self.inner.list()

    def exists(self, name):
        return self.inner.exists(name)

    def staging(self, save_id):
        return self.inner.staging(save_id)

    def commit(self, staging, overwrite, sync):
        self.inner.commit(staging, overwrite, sync)

    def discard(self, staging):
        self.inner.discard(staging)

    def incomplete_saves(self):
        return self.inner.incomplete_saves()


class _CountingReader(BlobReader):
    """Logs every read; ``readv`` and ``pread`` are BlobReader's, through ``readinto``."""

    def __init__(self, inner, name, log):
        self.inner, self.name, self.log, self.size = inner, name, log, inner.size
        self.small_reads_are_cheap = inner.small_reads_are_cheap

    def readinto(self, buf, offset):
        got = self.inner.readinto(buf, offset)
        self.log.append((self.name, offset, got))
        return got

    def readv_cached(self, views, offset):
        return None

    def identity(self):
        return self.inner.identity()

    def close(self):
        self.inner.close()


WTE = torch.randn(4000, 64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ckpt_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("open") / "ck")
    g = torch.Generator().manual_seed(2)
    distckpt.save({"model": {"wte": WTE.clone(), "cube": torch.randn(6, 5, 7, generator=g).to(torch.bfloat16),
                             "scalar": torch.tensor(2.5), "ids": torch.randint(0, 99, (50,), generator=g),
                             "empty": torch.zeros(0, 4)},
                   "progress": {"step": 12, "name": "run"}}, checkpoint_id=path)
    return path


def _full_load(path):
    md = distckpt.read_metadata(path)
    state = {k: torch.empty(tuple(e.size), dtype=e.properties.dtype) for k, e in md.state_dict_metadata.items()
             if isinstance(e, distckpt.TensorStorageMetadata)}
    distckpt.load(state, checkpoint_id=path, no_dist=True)
    return state


def test_a_slice_reads_only_the_bytes_of_its_rows(ckpt_path):
    log = []
    reader = BlobStorageReader(CountingStore(FsStore(ckpt_path), log))
    with distckpt.open(storage_reader=reader) as ckpt:
        info = ckpt.metadata.storage_data.items[MetadataIndex("model.wte", (0, 0))]
        wte = ckpt["model.wte"]
        assert (wte.shape, wte.dtype, wte.chunks) == (torch.Size([4000, 64]), torch.float32, [((0, 0), (4000, 64))])
        assert [name for name, _, _ in log] == ["metadata.json"]  # nothing but the metadata yet
        del log[:]
        counted = FileReads()
        got = wte[1000:2000]
        row = 64 * 4
        data_reads = [(o, n) for name, o, n in log if o >= info.offset]
        assert data_reads == [(info.offset + 1000 * row, 1000 * row)]  # one ranged read, those rows only
        header = sum(n for name, o, n in log if o < info.offset)
        assert header <= 4096 and ckpt.bytes_read == 1000 * row  # plus the file's header, once
        assert counted.total == 1000 * row + header
        assert torch.equal(got, WTE[1000:2000])
        before = len(log)
        assert torch.equal(wte[5:7, 10:12], WTE[5:7, 10:12])
        assert [(o, n) for _, o, n in log[before:]] == [(info.offset + 5 * row, 2 * row)]  # the file is not validated again


def test_slices_are_bit_exact_against_a_full_load(ckpt_path):
    full = _full_load(ckpt_path)
    rng = random.Random(0)
    with distckpt.open(ckpt_path) as ckpt:
        for key in ("model.wte", "model.cube", "model.scalar", "model.ids", "model.empty"):
            lazy, want = ckpt[key], full[key]
            assert torch.equal(lazy.read(), want) and lazy.read().dtype == want.dtype
            for _ in range(60):
                index = _random_index(rng, want.shape)
                got = lazy[index]
                assert got.shape == want[index].shape and got.dtype == want.dtype, (key, index)
                assert torch.equal(_bits(got), _bits(want[index])), (key, index)
        assert ckpt["progress.step"] == 12 and ckpt["progress.name"] == "run"
        assert dict(ckpt.items()).keys() == set(full) | {"progress.step", "progress.name"}


def _bits(t):
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _random_index(rng, shape):
    parts = []
    for size in shape:
        kind = rng.random()
        if kind < 0.25 and size:
            parts.append(rng.randrange(-size, size))
        elif kind < 0.35:
            parts.append(None)
            parts.append(slice(None))
        else:
            lo = rng.choice([None, rng.randrange(-size - 2, size + 3)])
            hi = rng.choice([None, rng.randrange(-size - 2, size + 3)])
            parts.append(slice(lo, hi, rng.choice([None, 1, 2, 3, 7])))
    if parts and rng.random() < 0.3:
        cut = rng.randrange(len(parts))
        parts = parts[:cut] + [Ellipsis]
    return tuple(parts) if len(parts) != 1 or rng.random() < 0.5 else parts[0]


def test_chunks_of_a_two_rank_save_read_at_one_process(tmp_path_factory):
    path = open_workers.sharded_checkpoint(tmp_path_factory)
    inside = open_workers.read_inside()  # rank 0 opened it alone inside the group
    assert torch.equal(inside["rows"], open_workers.ROWS[10:20]) and torch.equal(inside["cols"], open_workers.COLS[2:5, 3:8])
    assert inside["step"] == 3 and inside["chunks"] == [((0, 0), (12, 5)), ((0, 5), (12, 5))]
    full = _full_load(path)
    with distckpt.open(path) as ckpt:
        cols = ckpt["model.cols"]
        before = ckpt.bytes_read
        got = cols[4:6]  # two rows, from each of the two column chunks
        assert torch.equal(got, open_workers.COLS[4:6]) and torch.equal(got, full["model.cols"][4:6])
        assert ckpt.bytes_read - before == 2 * 10 * 2  # 2 rows x 5 columns x 2 bytes, from each chunk
        rows = ckpt["model.rows"]
        assert [c for c in rows.chunks] == [((0, 0), (15, 8)), ((15, 0), (15, 8))]
        for index in [slice(14, 16), slice(0, 30, 4), (slice(None), 3), (Ellipsis, slice(2, 7, 2)), 15, -1]:
            assert torch.equal(rows[index], full["model.rows"][index]), index
        before = ckpt.bytes_read
        rows[13:17]
        assert ckpt.bytes_read - before == 4 * 8 * 4  # rows 13-14 of one chunk, 15-16 of the other
        assert torch.equal(ckpt["model.bias"].read(), open_workers.BIAS)
        rebuilt = torch.zeros_like(open_workers.COLS)
        for offsets, piece in cols.pieces(64):  # whole rows of each chunk, 64 bytes at most: 6 rows of 5 bf16
            assert piece.numel() * 2 <= 64
            rebuilt[offsets[0]:offsets[0] + piece.shape[0], offsets[1]:offsets[1] + piece.shape[1]] = piece
        assert torch.equal(rebuilt, open_workers.COLS)


def _flip(path, key, offsets, at):
    md = distckpt.read_metadata(path)
    info = md.storage_data.items[MetadataIndex(key, offsets)]
    with open(os.path.join(path, info.file), "r+b") as f:
        f.seek(info.offset + at)
        byte = f.read(1)[0]
        f.seek(info.offset + at)
        f.write(bytes([byte ^ 0x10]))
    return info


def test_whole_chunks_are_checksummed_and_verify_slices_reads_every_touched_chunk_whole(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": WTE[:100].clone(), "step": 4}, checkpoint_id=path)
    info = _flip(path, "w", (0, 0), 10 * 64 * 4 + 3)  # a byte of row 10
    with distckpt.open(path) as ckpt:
        assert torch.equal(ckpt["w"][50:60], WTE[50:60])  # read in part: no checksum can tell, and row 10 is not read
        with pytest.raises(CorruptCheckpointError) as err:
            ckpt["w"].read()
        assert "'w'" in str(err.value) and "chunk [0, 0]" in str(err.value) and info.file in str(err.value)
        with pytest.raises(CorruptCheckpointError):
            ckpt["w"][0:100]  # every row of the chunk: read whole, so checked
    with distckpt.open(path, verify_slices=True) as ckpt:
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            ckpt["w"][50:60]
    with distckpt.open(path, verify_checksums=False) as ckpt:
        assert not torch.equal(ckpt["w"].read(), WTE[:100])
    _flip(path, "step", None, 2)
    with distckpt.open(path) as ckpt, pytest.raises(CorruptCheckpointError, match="'step'"):
        ckpt["step"]


def test_chunks_stored_through_a_codec_are_read_whole_and_decoded(tmp_path):
    from distckpt import FileSystemWriter, ZStandard

    path = str(tmp_path / "zstd")
    state = {"w": WTE[:300].clone(), "cfg": {"lr": 0.5}}
    distckpt.save(state, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]))
    with distckpt.open(path) as ckpt:
        info = ckpt.metadata.storage_data.items[MetadataIndex("w", (0, 0))]
        assert info.codec != "identity"
        assert torch.equal(ckpt["w"][10:20, ::3], WTE[10:20, ::3])
        assert ckpt.bytes_read == info.length  # the stored chunk whole, decoded
        assert ckpt["cfg.lr"] == 0.5


def test_a_dcp_directory_and_a_memory_checkpoint_open(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": WTE[:64].clone(), "step": 9}, checkpoint_id=path, no_dist=True)
    with distckpt.open(path) as ckpt:
        assert ckpt.metadata.storage_data.layout == "DCP"
        assert torch.equal(ckpt["w"][3:9, 1::5], WTE[3:9, 1::5])
        info = ckpt.metadata.storage_data.items[MetadataIndex("w", (0, 0))]
        assert info.codec != "identity" and ckpt.bytes_read == info.length  # DCP's torch.save archive: read whole
        assert ckpt["step"] == 9
    distckpt.save({"w": WTE[:64].clone(), "step": 9}, checkpoint_id="memory://open-test")
    with distckpt.open("memory://open-test") as ckpt:
        assert torch.equal(ckpt["w"][60:], WTE[60:64]) and ckpt["step"] == 9


def test_bad_keys_and_indices_and_closed_checkpoints_raise_typed_errors(ckpt_path):
    ckpt = distckpt.open(ckpt_path)
    with pytest.raises(MissingKeyError, match="did you mean 'model.wte'"):
        ckpt["model.wt"]
    with pytest.raises(MissingKeyError, match="'model.cube'"):
        ckpt["model.cub"]
    assert ckpt.get("nope") is None and "model.wte" in ckpt and "nope" not in ckpt and len(ckpt) == 7
    wte = ckpt["model.wte"]
    for index, text in [(4000, "out of bounds for dimension 0 with size 4000"), ((0, -65), "dimension 1 with size 64"),
                        ((0, 0, 0), "too many indices"), (slice(None, None, -1), "greater than zero"),
                        (torch.tensor([1, 2]), "read it whole"), ([1, 2], "read it whole"), ((..., ...), "single ellipsis"),
                        (slice(0, 2.5), "must be ints")]:
        with pytest.raises(CheckpointIndexError, match=text):
            wte[index]
    with pytest.raises(IndexError):  # an IndexError, as torch raises
        wte[-4001]
    ckpt.close()
    assert ckpt.closed
    with pytest.raises(CheckpointClosedError, match="closed"):
        wte[0]
    with pytest.raises(CheckpointClosedError):
        ckpt["progress.step"]
    ckpt.close()  # twice: nothing
    with pytest.raises(distckpt.CheckpointNotFoundError):
        distckpt.open(os.path.join(ckpt_path, "nope"))


def test_index_arithmetic():
    sel = select((slice(1, 9, 3), None, -1), (10, 4), "t")
    assert [(a.start, a.step, a.count, a.keep) for a in sel.axes] == [(1, 3, 3, True), (3, 1, 1, False)]
    assert sel.view == (slice(None), None, 0) and sel.block_shape == (3, 1)
    assert row_runs(5, 3, 1, 100, 0) == [(5, 8)]
    assert row_runs(5, 3, 10, 100, 1000) == [(5, 26)]  # gaps of 900 bytes: cheaper read than skipped
    assert row_runs(5, 3, 10, 1000, 1000) == [(5, 6), (15, 16), (25, 26)]
    assert row_blocks(30, [15, 30], 20) == [(0, 15), (15, 30)]  # cut at the chunk boundary
    assert row_blocks(30, [15], 10) == [(0, 10), (10, 15), (15, 25), (25, 30)]
    assert row_blocks(5, [], 0) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
