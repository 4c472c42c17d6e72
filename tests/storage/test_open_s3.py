"""distckpt.open on an S3-compatible server (moto's, on loopback): a slice is one ranged GET of its rows (after
the data file's header), bit-exact, and a damaged object is named as on disk."""

from __future__ import annotations

import uuid

import boto3
import pytest
import torch

import distckpt
from distckpt.backends import S3Reader
from distckpt.metadata import MetadataIndex

WTE = torch.randn(2000, 32, generator=torch.Generator().manual_seed(3))


def _counting_client(endpoint, gets):
    """A client that logs each GetObject: (key, Range header)."""
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.meta.events.register("before-parameter-build.s3.GetObject",
                                lambda params, **kwargs: gets.append((params["Key"], params.get("Range"))))
    return client


def test_a_slice_on_s3_is_one_ranged_get_of_its_rows(bucket, endpoint):
    url = f"s3://{bucket}/open-{uuid.uuid4().hex}"
    distckpt.save({"model": {"wte": WTE.clone()}, "progress": {"step": 4}}, checkpoint_id=url)
    gets = []
    with distckpt.open(storage_reader=S3Reader(url, client=_counting_client(endpoint, gets))) as ckpt:
        info = ckpt.metadata.storage_data.items[MetadataIndex("model.wte", (0, 0))]
        seen = len(gets)
        got = ckpt["model.wte"][500:600]
        assert torch.equal(got, WTE[500:600])
        data = [(key, rng) for key, rng in gets[seen:] if key.endswith(info.file)]
        row = 32 * 4
        begin = info.offset + 500 * row
        assert data[-1][1] == f"bytes={begin}-{begin + 100 * row - 1}"  # the rows, in one ranged GET
        assert all(rng.startswith("bytes=0-") for _, rng in data[:-1])  # before it: the header, once
        assert ckpt.bytes_read == 100 * row
        seen = len(gets)
        assert torch.equal(ckpt["model.wte"][1999], WTE[1999]) and len(gets) == seen + 1
    with distckpt.open(url) as ckpt:  # by its id alone, as load takes it
        assert ckpt["progress.step"] == 4 and torch.equal(ckpt["model.wte"][::400, 3], WTE[::400, 3])


def test_a_damaged_object_on_s3_is_named(client, bucket):
    prefix = f"open-{uuid.uuid4().hex}"
    url = f"s3://{bucket}/{prefix}"
    distckpt.save({"w": WTE[:100].clone()}, checkpoint_id=url)
    md = distckpt.read_metadata(url)
    info = md.storage_data.items[MetadataIndex("w", (0, 0))]
    key = next(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
               if o["Key"].endswith(info.file))
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[info.offset + 7] ^= 0x04
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with distckpt.open(url) as ckpt:
        with pytest.raises(distckpt.CorruptCheckpointError, match="checksum mismatch") as err:
            ckpt["w"].read()
        assert info.file in str(err.value) and "'w'" in str(err.value)
