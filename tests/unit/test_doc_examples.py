"""Every ```python block of README.md and docs/ runs, as written, against a small state (what a reader copies must
work): paths under /ckpt/ go to a temporary directory. A block that cannot run here says why on the line before it
(``<!-- fragment: needs ... -->``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import distckpt
from distckpt import events

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"(<!-- fragment: ([^>]*?) -->\n)?```python\n(.*?)```", re.S)


def blocks() -> list:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start(3))
            found.append(pytest.param(match.group(3), match.group(2), id=f"{doc.name}:{line}"))
    return found


@pytest.mark.parametrize("source,fragment", blocks())
def test_a_documented_example_runs(source, fragment, tmp_path):
    if fragment is not None:
        assert fragment.strip(), "a fragment says what it needs"
        pytest.skip(f"fragment: {fragment}")
    namespace = {"distckpt": distckpt, "torch": torch, "step": 1, "path": str(tmp_path / "ck"),
                 "state": {"w": torch.arange(16, dtype=torch.float32), "progress": {"step": 1}}}
    before = list(events._OBSERVERS)
    try:
        exec(compile(source.replace("/ckpt/", f"{tmp_path}/ckpt/"), "<example>", "exec"), namespace)
        for value in namespace.values():
            if isinstance(value, distckpt.AsyncSaveHandle):
                value.result(timeout=120)
    finally:
        for observation in [o for o in events._OBSERVERS if o not in before]:  # what the example registered
            observation.close()


def test_every_document_with_examples_is_read():
    names = {p.id.split(":")[0] for p in blocks()}
    assert {"README.md", "operating.md", "relayout.md", "stores.md"} <= names
