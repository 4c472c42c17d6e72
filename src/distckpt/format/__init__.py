"""The on-disk format: metadata codec, data-file layout, checksums, value encoding.

See docs/format.md for the normative specification.
"""

FORMAT_NAME = "distckpt"
FORMAT_VERSION = (4, 0)  # the newest version this package writes and reads
REFERENCE_FORMAT_VERSION_STR = "4.0"  # written when a data file is another checkpoint's, or a codec record checks decoded bytes
FORMAT_VERSION_STR = "3.0"  # written when the document has a table of whole tensors (docs/format.md, 1)
BASE_FORMAT_VERSION_STR = "2.0"  # written when the document needs nothing later
CODEC_FORMAT_VERSION_STR = "2.1"  # written when an item is stored through a codec and no table is needed
DATA_FILE_VERSION_STR = "2.0"  # what a data file's header records: its layout has not changed since
METADATA_FILE = "metadata.json"

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "FORMAT_VERSION_STR", "BASE_FORMAT_VERSION_STR", "CODEC_FORMAT_VERSION_STR",
           "REFERENCE_FORMAT_VERSION_STR", "DATA_FILE_VERSION_STR", "METADATA_FILE"]
