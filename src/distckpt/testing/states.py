"""Small state dicts for tests, and their comparison: what every test of saving and loading needs.

``seeded`` builds a reproducible state from shapes; ``blank_like`` is what a
caller passes to ``load`` to get it back (tensors of the same shape and dtype,
zeroed; values as placeholders); ``assert_same`` checks a loaded state
bit-exact, dtypes included.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["seeded", "blank_like", "assert_same"]


def seeded(shapes: dict[str, Any], seed: int = 0, values: Optional[dict] = None) -> dict:
    """A state dict with a random float32 tensor of each shape in ``shapes`` (a tensor given there is kept
    as it is), drawn from ``seed``, plus the plain ``values``."""
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    for key, shape in shapes.items():
        if isinstance(shape, torch.Tensor):
            out[key] = shape
        else:
            out[key] = torch.randn(shape if isinstance(shape, tuple) else (shape,), generator=g)
    out.update(values or {})
    return out


def blank_like(state: Any) -> Any:
    """A destination for loading ``state``: zeroed tensors of the same shape and dtype, dicts of the same
    keys (nested), and None for every other value."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: blank_like(v) for k, v in state.items()}
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaNs compare equal as bytes, and -0.0 differs from 0.0)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Raise AssertionError, naming the key, unless ``got`` equals ``want`` bit for bit (tensors: dtype,
    shape and bytes; dicts key by key; other values by ==)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__}, not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{path}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        assert torch.equal(_bytes(got), _bytes(want)), f"{path}: tensor bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}" if path else str(k))
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
