"""Counting the bytes a process's loads read from files, as a test or bench asserts what a rank read.

A process's ``rchar`` counts its process group's socket traffic as well, and mapped reads not at all; this counts
what distckpt's file readers return, in this process, from the moment it is created.
"""

from __future__ import annotations

from ..backends import filesystem

__all__ = ["FileReads"]


class FileReads:
    """Bytes returned by distckpt's file readers in this process since this object was made (``total``)."""

    def __init__(self) -> None:
        self.total = 0
        cls = filesystem.FileReader
        readinto, readv = cls.readinto, cls.readv
        counter = self

        def counted_readinto(reader, buf, offset):
            got = readinto(reader, buf, offset)
            counter.total += got
            return got

        def counted_readv(reader, views, offset):
            got = readv(reader, views, offset)
            counter.total += got
            return got
        cls.readinto, cls.readv = counted_readinto, counted_readv
