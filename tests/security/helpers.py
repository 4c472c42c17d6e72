import json
import os
import shutil

import torch

import distckpt
from distckpt.format.checksum import crc32c
from distckpt.testing.states import blank_like  # noqa: F401 - the tests here import it from this module


def make_checkpoint(path, seed=0, scale=1):
    g = torch.Generator().manual_seed(seed)
    sd = {
        "w": torch.randn(64 * scale, 48, generator=g),
        "b": torch.randn(48, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1000, (300,), generator=g),
        "mask": torch.randn(7, 9, generator=g) > 0,
        "step": 1234,
        "cfg": {"name": "model", "lr": 0.1},
    }
    distckpt.save(sd, checkpoint_id=path)
    return sd


def snapshot(sd):
    return {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def read_body(path):
    raw = open(os.path.join(path, "metadata.json"), "rb").read()
    end = raw.rindex(b',"crc32c":')
    return json.loads(raw[:end] + b"}")


def write_body(path, body):
    """Write a metadata document with a valid checksum, as an attacker could."""
    text = json.dumps(body, separators=(",", ":")).encode()
    prefix = text[:-1]
    doc = prefix + b',"crc32c":"' + f"{crc32c(prefix):08x}".encode() + b'"}\n'
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(doc)


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst
