"""The demonstration end to end, at a small size: FSDP2 + AdamW save, crash, resume, reshard."""

from distckpt.demo.__main__ import main


def test_demo_resumes_exactly_and_reshards_bit_exact(tmp_path, capsys):
    rc = main(["--steps", "7", "--every", "3", "--crash-after", "5", "--dir", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    assert "the loss curve continues exactly" in out
    assert "1 rank(s) == 2 ranks" in out and "3 rank(s) == 2 ranks" in out
    assert rc == 0, out
