"""Load paths hold no more than the memory budget lets them (issue 48; the RSS itself is measured by
bench/load_memory.py): S3 bodies read in bounded pieces, chunks read whole held once, a torch.save file broadcast a
batch of keys at a time."""

import io
import tracemalloc

import torch

import distckpt
from distckpt.backends import s3_objects
from distckpt.engine.blobs import BytesReader
from distckpt.engine.chunk_reads import read_exact
from distckpt.format_utils import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner
from distckpt.layouts.torch_save import _StridedView
from distckpt.layouts.torch_zip import StorageRef, TensorRef

MiB = 1 << 20


class _Body:
    """A response body that records how much each ``readinto`` asked for (urllib3 allocates that much)."""

    def __init__(self, data: bytes) -> None:
        self.stream, self.asked = io.BytesIO(data), []

    def readinto(self, b) -> int:
        self.asked.append(len(b))
        return self.stream.readinto(b)


def test_an_s3_body_is_read_in_bounded_pieces():
    data = bytes(range(256)) * (14 * 1024)  # 3.5 MiB
    body = _Body(data)
    views = [memoryview(bytearray(MiB // 2)), memoryview(bytearray(3 * MiB))]
    progress = [0]
    ended = s3_objects._fill(body, views, 0, len(data), progress)
    assert not ended and progress[0] == len(data)
    assert bytes(views[0]) + bytes(views[1]) == data
    assert max(body.asked) <= s3_objects.BODY_PIECE_BYTES < 3 * MiB
    # a retry from the middle of the second view asks for pieces too, and fills from there
    body = _Body(data[2 * MiB:])
    out = [memoryview(bytearray(MiB // 2)), memoryview(bytearray(3 * MiB))]
    progress = [0]
    s3_objects._fill(body, out, 2 * MiB, len(data), progress)
    assert progress[0] == len(data) - 2 * MiB and bytes(out[1][3 * MiB // 2:]) == data[2 * MiB:]
    assert max(body.asked) <= s3_objects.BODY_PIECE_BYTES


def _peak(fn) -> int:
    """Peak bytes Python allocated while ``fn`` ran (bytearrays and bytes included; torch's own memory not)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_chunk_read_whole_is_held_once():
    blob = BytesReader(bytes(4 * MiB))
    got = []
    peak = _peak(lambda: got.append(read_exact(blob, 4 * MiB, 0, "here", "file")))
    assert len(got[0]) == 4 * MiB and peak < MiB  # no copy of the buffer into bytes (the buffer itself is a mapping)
    assert not memoryview(got[0]).readonly  # decoders may view it in place


_RETAINED = """
import threading
from distckpt.engine.blobs import BytesReader
from distckpt.engine.chunk_reads import read_exact

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

blob = BytesReader(bytes(8 << 20))
def work():
    for mib in (8, 7, 6, 5, 4, 3, 2, 8, 3):
        buf = read_exact(blob, mib << 20, 0, "here", "file")
        del buf
base = rss()
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(rss() - base)
"""


def test_chunk_buffers_freed_on_several_threads_go_back_to_the_kernel():
    """glibc keeps freed blocks below its (raised) mmap threshold in per-thread arenas: bytearrays of these sizes
    left 24 MiB resident here. Buffers of a MiB and more are mappings of their own, unmapped when freed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RETAINED], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 4, out.stdout


def test_a_strided_torch_save_tensor_views_the_read_buffer():
    span = torch.arange(MiB, dtype=torch.float32)  # 4 MiB of storage
    ref = TensorRef(StorageRef("0", torch.float32, 4 * MiB), 0, (512, 1024), (2048, 1), torch.float32)  # every other run
    stored = bytearray(span.numpy().tobytes()[: (511 * 2048 + 1024) * 4])
    out = []
    peak = _peak(lambda: out.append(_StridedView(ref).decode(memoryview(stored), 2 * MiB, "here")))
    want = span[: 511 * 2048 + 1024].as_strided((512, 1024), (2048, 1))
    assert torch.equal(torch.frombuffer(bytearray(out[0]), dtype=torch.float32).view(512, 1024), want)
    assert peak < MiB  # no copy of the 4 MiB span


def test_a_torch_save_file_is_broadcast_a_batch_at_a_time(tmp_path, monkeypatch):
    """The coordinator of BroadcastingTorchSaveReader reads at most half the budget of tensors at once (one larger
    tensor alone) into one buffer, not the whole file."""
    from distckpt import torch_save_reader

    path = str(tmp_path / "m.pt")
    state = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 1 MiB each
    state["big"] = torch.arange(3 * 256 * 1024, dtype=torch.float32)  # 3 MiB, over half the budget: alone
    torch.save(state, path)
    monkeypatch.setenv("DISTCKPT_MEMORY_BUDGET_BYTES", str(2 * MiB))
    buffers = []
    real = torch_save_reader.fresh_buffer
    monkeypatch.setattr(torch_save_reader, "fresh_buffer", lambda n: buffers.append(n) or real(n))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    peak = _peak(lambda: distckpt.load(out, storage_reader=BroadcastingTorchSaveReader(path), planner=DynamicMetaLoadPlanner(),
                                       no_dist=True))
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert buffers == [3 * MiB] and peak < MiB  # one buffer, of the big one's size, for the file's 11 MiB; no copies
