"""Test kits shipped with distckpt, for its own tests and for third-party backends and planners.

- :func:`run_ranks`: run a function on N real processes over torch.distributed (gloo);
- :mod:`.storage_suite`: a backend through save, load and verify (subclass ``StorageSuite``);
- :mod:`.blob_store_suite`: a BlobStore's methods, directly (subclass ``BlobStoreSuite``);
- :mod:`.crash_model`: ranks SIGKILLed at every boundary of a save, on any backend a CheckpointManager holds;
- :mod:`.states`: small state dicts and their comparison, for tests;
- :class:`FaultProxy`: an HTTP proxy that injects faults between a client and an object store.
"""

from .fault_proxy import FaultProxy, Rule
from .multiprocess import RankError, RankFailure, run_ranks

__all__ = ["run_ranks", "RankError", "RankFailure", "FaultProxy", "Rule"]
