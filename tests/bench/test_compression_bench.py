"""A tiny run of bench/compression.py, so that it cannot rot: every variant saves and loads bit-exact (the bench asserts
it), and byte-grouped zstd stores fewer bytes than the raw state and than DCP's plain zstd."""

from bench import compression


def test_compression_bench_prints_its_table_at_a_tiny_size(tmp_path, capsys):
    results = compression.main(["--gib", "0.005", "--repeat", "1", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "byte planes of the bf16 weights" in out and "distckpt-zstd" in out
    stored = results["stored"]
    assert stored["distckpt-zstd"] < 0.85 * stored["raw"]
    assert "dcp-zstd" in results["skipped"] or stored["distckpt-zstd"] < stored["dcp-zstd"]
    low, high = results["planes"]
    assert low > 0.95 and high < 0.6  # the low mantissa byte is near random; the exponent byte shrinks
