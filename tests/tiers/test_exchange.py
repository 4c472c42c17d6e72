"""The tier's transfers between two ranks: files in chunks through small rings, into a fresh directory or over the
files of a spare one, byte for byte."""

import os

import pytest

from distckpt.testing import run_ranks


def _swap(rank, world_size, root, mapped):
    import torch.distributed as dist

    from distckpt.tiers.exchange import Buffers, dir_manifest, reuse_spare, transfer

    mine = os.path.join(root, f"src-{rank}")
    os.makedirs(mine)
    sizes = {"a.bin": 2500, "empty": 0, "b.bin": 999, "c.bin": 1000}
    for i, (name, size) in enumerate(sizes.items()):
        with open(os.path.join(mine, name), "wb") as f:
            f.write(bytes((rank * 7 + i + j) % 251 for j in range(size)))
    parent = os.path.join(root, f"held-{rank}")
    spare = os.path.join(parent, ".spare")
    os.makedirs(spare)
    # a spare step with other names and sizes, and a directory in it: all of it is reused or removed
    for name, size in (("old-1", 4000), ("old-2", 10), ("old-3", 10), ("old-4", 10), ("old-5", 5)):
        with open(os.path.join(spare, name), "wb") as f:
            f.write(b"\xff" * size)
    os.makedirs(os.path.join(spare, "nested"))
    buffers = Buffers(chunk_bytes=1000, depth=2, mapped=mapped)  # chunks span file ends: 2500 -> 1000, 1000, 500
    peer = 1 - rank
    manifests = [None, None]
    dist.all_gather_object(manifests, dir_manifest(mine))
    results = []
    for use_spare in (True, False):
        final = os.path.join(parent, f"step-{int(use_spare)}")
        tmp = final + ".incoming"
        if use_spare:
            reuse_spare(spare, tmp, manifests[peer])
        else:
            os.mkdir(tmp)
        transfer([(mine, manifests[rank], peer)], [(tmp, manifests[peer], peer)], dist.group.WORLD, buffers)
        os.rename(tmp, final)
        results.append({name: open(os.path.join(final, name), "rb").read().hex() for name in sorted(os.listdir(final))})
    expected = {name: bytes((peer * 7 + i + j) % 251 for j in range(size)).hex() for i, (name, size) in enumerate(sizes.items())}
    return {"results": results, "expected": expected, "left": sorted(os.listdir(parent))}


@pytest.mark.parametrize("mapped", [False, True], ids=["rings", "mapped"])
def test_transfer_is_byte_exact_through_small_rings_and_over_a_spare(tmp_path, mapped):
    for out in run_ranks(_swap, 2, str(tmp_path), mapped, timeout_s=120):
        assert out["results"][0] == out["expected"]  # over the spare's files: nothing of them is left in the copy
        assert out["results"][1] == out["expected"]
        assert out["left"] == ["step-0", "step-1"]  # the spare was used up; no hidden directory is left


def test_transfers_map_files_only_on_a_tmpfs_of_huge_pages(tmp_path, huge_tmpfs, small_page_tmpfs):
    from distckpt.tiers.exchange import Buffers, huge_pages

    inner = os.path.join(huge_tmpfs, "node", "own")  # the mount point's name has a space: escaped in mountinfo
    os.makedirs(inner)
    assert huge_pages(huge_tmpfs) and huge_pages(inner)
    assert not huge_pages(small_page_tmpfs) and not huge_pages(str(tmp_path))
    os.symlink(inner, tmp_path / "link")  # the mount of where a path leads decides, not of where its name is
    assert huge_pages(str(tmp_path / "link"))
    assert Buffers().maps(inner) and not Buffers().maps(small_page_tmpfs)
    assert not Buffers(mapped=False).maps(inner) and Buffers(mapped=True).maps(small_page_tmpfs)
