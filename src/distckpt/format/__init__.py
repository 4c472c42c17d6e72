"""The on-disk format: metadata codec, data-file layout, checksums, value encoding.

See docs/format.md for the normative specification.
"""

FORMAT_NAME = "distckpt"
FORMAT_VERSION = (2, 0)
FORMAT_VERSION_STR = "2.0"
CODEC_FORMAT_VERSION_STR = "2.1"  # written only when an item is stored through a codec (docs/format.md, 1)
METADATA_FILE = "metadata.json"

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "FORMAT_VERSION_STR", "CODEC_FORMAT_VERSION_STR", "METADATA_FILE"]
