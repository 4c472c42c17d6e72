"""compression="zstd" on S3: the writer's option passes through, objects hold the stored bytes, loads and open slices decode."""

import torch

import distckpt
from distckpt.backends.s3 import S3Reader, S3Writer


def test_compressed_save_to_s3_loads_opens_and_verifies(bucket):
    cid = f"s3://{bucket}/zstd/step-1"
    g = torch.Generator().manual_seed(5)
    sd = {"w": (torch.randn(512, 512, generator=g) * 0.02).to(torch.bfloat16), "step": 4}
    md = distckpt.save(sd, checkpoint_id=cid, storage_writer=S3Writer(compression="zstd"))
    info = md.storage_data.items[next(ix for ix in md.storage_data.items if ix.fqn == "w")]
    assert info.codec.startswith("bytegroup.zstd/1") and info.length < 0.75 * sd["w"].nbytes
    out = {"w": torch.zeros(512, 512, dtype=torch.bfloat16), "step": None}
    distckpt.load(out, checkpoint_id=cid, storage_reader=S3Reader())
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 4
    with distckpt.open(cid) as ckpt:
        assert torch.equal(ckpt["w"][100:110, 7], sd["w"][100:110, 7])
    assert distckpt.verify(cid).ok
