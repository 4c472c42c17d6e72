"""What the golden checkpoints hold. Never change a value here once a version is released."""

import torch


def plain_state() -> dict:
    return {
        "f32": torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7,
        "bf16": (torch.arange(10, dtype=torch.float32) - 3.5).to(torch.bfloat16),
        "f16": torch.linspace(-2, 2, 9).to(torch.float16),
        "i64": torch.arange(-5, 5, dtype=torch.int64) * (2**40),
        "u8": torch.arange(256, dtype=torch.uint8),
        "mask": torch.tensor([[True, False, True], [False, False, True]]),
        "c64": torch.complex(torch.arange(3.0), -torch.arange(3.0)),
        "zerod": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "nested": {"layer": {"w": torch.ones(2, 2) * 3}},
        "values": {"step": 42, "name": "golden", "inf": float("inf"), "t": (1, "a"), "raw": b"\x00\xff", "none": None,
                   "ints": {1: "one"}, "dt": torch.bfloat16},
    }


def sharded_full() -> dict:
    """Tensors the 2-rank golden checkpoint holds, as full tensors."""
    return {
        "row": torch.arange(35, dtype=torch.float32).reshape(7, 5),
        "col": torch.arange(30, dtype=torch.int64).reshape(3, 10),
        "rep": torch.full((3, 3), 9.0),
    }


def compressed_state() -> dict:
    """What the compressed 4.0 golden checkpoint holds: plain_state, and tensors large enough for byte-grouped zstd to
    shrink (the plain ones are too small, and are stored as they are)."""
    # integer arithmetic, then exact division and IEEE rounding: the same bits on every machine (torch.sin is not:
    # its vectorised kernels differ by a unit in the last place between CPUs)
    wave = ((torch.arange(8192, dtype=torch.int64) * 7919) % 2001 - 1000).to(torch.float64) / 50000
    return {
        **plain_state(),
        "z_bf16": wave.to(torch.bfloat16).reshape(64, 128),
        "z_f32": wave.to(torch.float32),
        "z_f64": wave[:1024].clone(),
        "z_c64": torch.complex(wave[:2048], wave[2048:4096]).to(torch.complex64),
        "z_ids": torch.arange(4096, dtype=torch.int64) * 3,
        "z_text": {"notes": "compressed " * 64},
    }


def run_state(step: int) -> dict:
    """What step ``step`` of the 4.0 golden run of incremental saves (v4.0/run) holds: plain_state, whose tensors
    never change, and ones that change every step or every other step."""
    return {
        **plain_state(),
        "every": torch.full((3, 5), float(step)),
        "other": torch.arange(12, dtype=torch.int32) + step // 2,
        "values": {"step": step},
    }
