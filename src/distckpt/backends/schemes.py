"""Stores by the scheme of a checkpoint id: ``register_store("gs", factory)``, then ``checkpoint_id="gs://..."``.

A factory takes the checkpoint id (the whole string, scheme included) and returns the :class:`BlobStore`
of that checkpoint; :class:`~distckpt.backends.BlobStorageWriter` and
:class:`~distckpt.backends.BlobStorageReader` write and read any such store. A plain path has the scheme
``file``. The shipped stores register themselves here: ``file`` (:mod:`.filesystem`), ``memory``
(:mod:`.memory`), ``s3`` (:mod:`.s3`), each with its thin writer and reader classes (DCP's names and options).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..engine.blobs import BlobStore
from ..errors import CheckpointError

__all__ = ["StoreFactory", "register_store", "unregister_store", "scheme_of", "scheme_entry", "store_for", "looks_like_scheme_typo"]

StoreFactory = Callable[[str], BlobStore]
"""``factory(checkpoint_id) -> BlobStore``: the store of the checkpoint at ``checkpoint_id``."""

FILE = "file"


@dataclass(frozen=True)
class SchemeEntry:
    """What a scheme resolves to: its store factory, and the writer and reader classes ``save``/``load``
    build for it (None: :class:`~distckpt.backends.BlobStorageWriter` / ``BlobStorageReader``)."""

    factory: StoreFactory
    writer: Optional[type] = None
    reader: Optional[type] = None


_SCHEMES: dict[str, SchemeEntry] = {}
_FALLBACKS: list[Callable[[str], Optional[SchemeEntry]]] = []


def register_fallback(find: Callable[[str], Optional[SchemeEntry]]) -> None:
    """``find(scheme)`` answers for schemes no store is registered for (fsspec's, :mod:`.fsspec_store`); a
    registered store always comes first."""
    _FALLBACKS.append(find)


def register_store(scheme: str, factory: StoreFactory, *, writer: Optional[type] = None, reader: Optional[type] = None) -> None:
    """Make checkpoint ids ``scheme://...`` resolve to ``factory(checkpoint_id)`` (a plain path is scheme ``file``).

    ``writer``/``reader``: the storage layer classes that ``save``/``load`` build for such ids, for a store
    with options of its own (the default ones take the store from this registry). A later registration of
    the same scheme replaces the earlier one.
    """
    if not isinstance(scheme, str) or not scheme or "://" in scheme or "/" in scheme:
        raise CheckpointError(f"register_store: {scheme!r} is not a scheme; pass its name alone, as 'gs' for gs://...")
    if not callable(factory):
        raise CheckpointError(f"register_store({scheme!r}, ...): the factory must be callable as factory(checkpoint_id)")
    _SCHEMES[scheme] = SchemeEntry(factory, writer, reader)


def unregister_store(scheme: str) -> None:
    """Forget the store of ``scheme`` (no error if none is registered)."""
    _SCHEMES.pop(scheme, None)


def scheme_of(checkpoint_id: Any) -> Optional[str]:
    """The scheme of ``checkpoint_id``: the part before ``://``, ``file`` for a plain path; None for no string."""
    try:
        text = os.fspath(checkpoint_id)
    except TypeError:
        return None
    if not isinstance(text, str):
        return None
    scheme, sep, _ = text.partition("://")
    return scheme if sep else FILE


def scheme_entry(checkpoint_id: Any) -> Optional[SchemeEntry]:
    """The registration of ``checkpoint_id``'s scheme, or None."""
    scheme = scheme_of(checkpoint_id)
    if scheme is None:
        return None
    entry = _SCHEMES.get(scheme)
    for find in _FALLBACKS if entry is None and scheme != FILE else ():
        entry = find(scheme)
        if entry is not None:
            break
    return entry


def store_for(checkpoint_id: Any) -> BlobStore:
    """The store at ``checkpoint_id``, from the factory registered for its scheme.

    Whatever the factory raises or returns, the answer is a store or a CheckpointError naming the id and the
    scheme: a third-party factory's bare ValueError, or a return that is no store, would otherwise surface
    later as an AttributeError far from its cause."""
    entry = scheme_entry(checkpoint_id)
    if entry is None:
        raise CheckpointError(f"no store is registered for the scheme of checkpoint_id {str(checkpoint_id)!r}; register "
                              "one with distckpt.backends.register_store(scheme, factory), or pass a storage writer/reader")
    scheme = scheme_of(checkpoint_id)
    try:
        store = entry.factory(os.fspath(checkpoint_id))
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"the store of checkpoint_id {str(checkpoint_id)!r} (scheme {scheme!r}) could not be opened: "
                              f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(store, BlobStore):
        raise CheckpointError(f"the factory registered for scheme {scheme!r} returned a {type(store).__name__} for "
                              f"checkpoint_id {str(checkpoint_id)!r}, not a distckpt.backends.BlobStore; fix the factory "
                              "passed to register_store")
    return store


def looks_like_scheme_typo(text: str) -> Optional[str]:
    """The registered scheme ``text`` starts with followed by one slash (``s3:/bucket``), if it does: such an id
    is a typo of ``s3://bucket``, not a local directory named ``s3:``."""
    scheme, sep, rest = text.partition(":")
    if sep and scheme in _SCHEMES and scheme != FILE and not rest.startswith("//"):
        return scheme
    return None
