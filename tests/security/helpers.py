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


def per_key_entries(body):
    """``body`` with its table of whole tensors (format 3.0) written out as one ``state_dict_metadata`` entry
    per key, the form readers also accept for such tensors: tests damage one key's fields there."""
    table = body.pop("tensors", None)
    if table is None:
        return body
    entries, at = {}, 0
    for i, key in enumerate(table["keys"]):
        n = table["ndim"][i]
        size = table["size"][at:at + n]
        at += n
        entries[key] = {"type": "tensor", "size": size, "properties": list(table["properties"][table["property"][i]]),
                        "chunks": [[[0] * n, list(size), table["file"][i], table["offset"][i], table["crc32c"][i]]]}
    entries.update(body["state_dict_metadata"])
    body["state_dict_metadata"] = entries
    return body


def read_body(path, per_key=True):
    """The metadata document of ``path`` without its checksum; ``per_key``: see :func:`per_key_entries`."""
    raw = open(os.path.join(path, "metadata.json"), "rb").read()
    end = raw.rindex(b',"crc32c":')
    body = json.loads(raw[:end] + b"}")
    return per_key_entries(body) if per_key else body


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
