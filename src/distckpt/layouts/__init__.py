"""Layouts: other programs' checkpoints described as what distckpt's read engine reads.

A layout turns a checkpoint another program wrote (a DCP directory, a Hugging Face safetensors directory, a
``torch.save`` file) into :class:`~distckpt.metadata.Metadata` whose ``storage_data`` places every chunk and value
in a file (:class:`~distckpt.format.records.ForeignStorageData`), with a decoder for items not stored as they are
in memory. Every layout's output passes :func:`~distckpt.layouts.checks.check_layout` (the cover, bounds and overlap
rules of distckpt's own format), and the read engine then reads it as it reads its own checkpoints: the stored
dtype and shape against the metadata, decoders bounded by the chunk's size, the memory budget, the lanes, any
store. The validation policy follows from what the program recorded: headers, save id and CRC-32C for distckpt's
own files; bounds, and a checksum only where one exists, for another program's.
"""

from .checks import check_layout, check_planner_data
from .dcp import dcp_layout, parse_dcp_metadata
from .hf import hf_layout, parse_index, parse_shard_header

__all__ = ["check_layout", "check_planner_data", "dcp_layout", "parse_dcp_metadata", "hf_layout", "parse_index",
           "parse_shard_header"]
