"""docs/format.md is normative: what it states of the bytes on disk is checked against what distckpt writes."""

import re
from pathlib import Path

import distckpt

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"


def test_the_metadata_checksum_suffix_has_the_documented_length_and_form(tmp_path):
    found = re.search(r"the file MUST end with the (\d+) bytes\s*\n\s*\n {4}(\S+)\n", DOC.read_text())
    assert found, "docs/format.md no longer states the metadata's suffix as this test reads it"
    stated, template = int(found.group(1)), found.group(2).replace("\\n", "\n")
    assert len(template) == stated
    distckpt.save({"x": 1}, checkpoint_id=tmp_path / "ck")
    written = (tmp_path / "ck" / "metadata.json").read_bytes()
    suffix = written[-stated:]
    assert re.fullmatch(re.escape(template).replace("XXXXXXXX", "[0-9a-f]{8}").encode(), suffix)
    assert written[-stated - 1:-stated] != b","  # the suffix is the whole of it, not the end of a longer one
