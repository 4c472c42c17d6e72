"""``metadata.pkl`` stored as distckpt's tagged JSON: torch_checkpointing writes and reads a pickle, which is
turned into plain-data JSON on the way in and back into a pickle on the way out, so that no bytes from storage
are ever unpickled (unless ``pickled_metadata`` says the checkpoint is trusted)."""

from __future__ import annotations

import io
import pickle

from ...errors import CorruptCheckpointError, UnsafeValueError
from ...format.values import decode_value, encode_value


class _PlainData(pickle.Unpickler):
    """Unpickles only what needs no class: dicts, lists, tuples, strings, numbers, None."""

    def find_class(self, module: str, name: str):
        raise UnsafeValueError(f"{module}.{name}")


def metadata_to_json(raw: bytes, where: str) -> bytes:
    try:
        data = _PlainData(io.BytesIO(raw)).load()
    except UnsafeValueError as exc:
        raise UnsafeValueError(
            f"{where}: torch_checkpointing's metadata holds an object of class {exc}, which distckpt stores only as "
            "plain data; give the metadata's to_dict() plain values, or DistckptStorageConfig(pickled_metadata=True) "
            "to store the pickle (then load it only from storage you trust)") from None
    return encode_value(data, where=where)


def metadata_to_pickle(raw: bytes, where: str, pickled_ok: bool) -> bytes:
    try:
        data = decode_value(raw, where=where)
    except CorruptCheckpointError:
        if pickled_ok:
            return raw
        raise UnsafeValueError(f"{where} is not distckpt's JSON metadata (a pickle another backend wrote?); it is not "
                               "unpickled unless DistckptStorageConfig(pickled_metadata=True), for a checkpoint you trust") from None
    return pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
