"""Byte views of tensor memory: ``flat_bytes`` through numpy, ``memory_at`` at a data pointer."""

import os

import torch

from distckpt.engine.tensor_bytes import flat_bytes, memory_at


def test_memory_at_a_data_pointer_is_the_tensor_s_bytes_and_writable(tmp_path):
    for t in (torch.arange(10, dtype=torch.float32), torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
              torch.arange(20, dtype=torch.int64)[5:9], torch.tensor(True)):
        view = memory_at(t.data_ptr(), t.nbytes)
        assert bytes(view) == bytes(flat_bytes(t)) and not view.readonly
    t = torch.zeros(8, dtype=torch.int16)
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(16)))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [memory_at(t.data_ptr(), 6), memory_at(t.data_ptr() + 6, 10)], 0) == 16
    finally:
        os.close(fd)
    assert bytes(flat_bytes(t)) == bytes(range(16))
    assert len(memory_at(0, 0)) == 0
