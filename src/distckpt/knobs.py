"""Every tunable of distckpt, in one place, each with an environment override.

Read a knob through its function (``io_threads()``), so a test or a user can
change the environment at any time. Defaults are chosen for a node with fast
local disk; the docs of each function say why.
"""

from __future__ import annotations

import json
import os

from .errors import CheckpointError

__all__ = [
    "PAGE_BYTES",
    "io_threads",
    "min_file_bytes",
    "read_slab_bytes",
    "s3_pool_threads",
    "io_batch_bytes",
    "fsync_enabled",
    "overwrite_committed",
    "direct_io_mode",
    "direct_io_buffer_bytes",
    "direct_io_queue_depth",
    "direct_io_flush_threads",
    "memory_budget_bytes",
    "max_metadata_bytes",
    "max_header_bytes",
    "max_value_bytes",
    "collective_timeout_s",
    "allow_pickle_transport",
    "async_write_nice",
    "progress_mode",
    "progress_log_every_s",
    "lease_stale_s",
    "lease_renew_s",
    "s3_part_bytes",
    "s3_upload_concurrency",
    "s3_read_piece_bytes",
    "tier_dir",
    "tier_chunk_bytes",
    "tier_transfer_depth",
    "hf_copy_block_bytes",
    "node_id",
    "shared_reads",
    "shared_read_bucket_bytes",
]


#: Alignment of the data section of data files, of direct I/O buffers and of large staging buffers: a memory
#: page, and a multiple of every common logical block size (512 and 4096 bytes), so direct I/O can use them.
PAGE_BYTES = 4096


def _int(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise CheckpointError(f"environment variable {name}={raw!r} is not an integer; unset it or give a number") from None
    if value < minimum:
        raise CheckpointError(f"environment variable {name}={value} must be at least {minimum}")
    return value


def _float(name: str, default: float, minimum: float = 0.0) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise CheckpointError(f"environment variable {name}={raw!r} is not a number; unset it or give a number") from None
    if not value >= minimum:  # NaN too
        raise CheckpointError(f"environment variable {name}={value} must be at least {minimum}")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def io_threads() -> int:
    """Threads per rank that write or read data files (DISTCKPT_IO_THREADS).

    I/O and checksums release the GIL, so threads overlap them; but more busy
    threads than cores only adds switching. The default is this rank's share
    of the CPUs (CPUs / LOCAL_WORLD_SIZE, as torchrun sets it), from 1 to 4.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return _int("DISTCKPT_IO_THREADS", max(1, min(4, cpus // local)), minimum=1)


def object_write_streams() -> int:
    """Data files one rank writes at once to an object store (DISTCKPT_OBJECT_WRITE_STREAMS, default the larger of
    4 and DISTCKPT_IO_THREADS): its writes wait on the network more than on the CPU, and an object store serves
    several objects at once better than one large one (bench/object_stores.py, docs/performance.md)."""
    return _int("DISTCKPT_OBJECT_WRITE_STREAMS", max(4, io_threads()), minimum=1)


def io_batch_bytes() -> int:
    """Adjacent items are written or read together, one system call and one task per batch
    of up to this many bytes (DISTCKPT_IO_BATCH_BYTES, default 8 MiB)."""
    return _int("DISTCKPT_IO_BATCH_BYTES", 8 << 20, minimum=0)


def memory_budget_bytes() -> int:
    """Most bytes of transient buffers one rank holds at once: on save, the writers' buffers
    (direct I/O's bounce buffers, an object store's upload parts: together at most half the
    budget, split between the files written at once) and host copies of device or
    non-contiguous tensors (the rest); on load, read buffers for partially needed chunks
    (DISTCKPT_MEMORY_BUDGET_BYTES, default 1 GiB). One request larger than the budget goes
    through alone, and an object store's parts are never below S3's 5 MiB minimum.
    Async-save staging is a full copy of the state by nature and is not counted. Host copies
    of CUDA tensors are pinned, and torch's caching host allocator keeps them for the next
    save (rounded up to powers of two, so up to about twice this budget);
    ``torch.accelerator.empty_host_cache()`` (recent torch) gives them back."""
    return _int("DISTCKPT_MEMORY_BUDGET_BYTES", 1 << 30, minimum=1)


def s3_part_bytes() -> int:
    """Part size of S3 multipart uploads (DISTCKPT_S3_PART_BYTES, default 16 MiB; S3's minimum is 5 MiB)."""
    return _int("DISTCKPT_S3_PART_BYTES", 16 << 20, minimum=5 << 20)


def s3_upload_concurrency() -> int:
    """Parts of one S3 object uploading at once (DISTCKPT_S3_UPLOAD_CONCURRENCY, default 4)."""
    return _int("DISTCKPT_S3_UPLOAD_CONCURRENCY", 4, minimum=1)


def s3_read_piece_bytes() -> int:
    """A read of at least twice this many bytes from S3 is split into ranged GETs of this size,
    fetched in parallel (DISTCKPT_S3_READ_PIECE_BYTES, default 16 MiB)."""
    return _int("DISTCKPT_S3_READ_PIECE_BYTES", 16 << 20, minimum=1 << 20)


def min_file_bytes() -> int:
    """Smallest data file a save thread gets (DISTCKPT_MIN_FILE_BYTES, default 64 MiB): a rank's items are
    split over up to io_threads() files, one per thread, but never into files smaller than this, where the
    cost of another file (its header, open, fsync) outweighs the parallel write."""
    return _int("DISTCKPT_MIN_FILE_BYTES", 64 << 20, minimum=1)


def read_slab_bytes() -> int:
    """Bytes of the host buffer a load reads rows of a chunk through when the destination is not contiguous
    (DISTCKPT_READ_SLAB_BYTES, default 32 MiB, capped by the memory budget): large enough that each read
    is a long sequential one, small enough to stay in the last-level cache's neighbourhood."""
    return _int("DISTCKPT_READ_SLAB_BYTES", 32 << 20, minimum=PAGE_BYTES)


def s3_pool_threads() -> int:
    """Threads per process that run S3 requests (DISTCKPT_S3_POOL_THREADS, default 32): requests mostly wait
    on the network, so many run at once; uploads and reads in flight are bounded by their own knobs."""
    return _int("DISTCKPT_S3_POOL_THREADS", 32, minimum=1)


def fsync_enabled() -> bool:
    """Whether data files, metadata and directories are fsynced on save (DISTCKPT_FSYNC, default on)."""
    return _bool("DISTCKPT_FSYNC", True)


def overwrite_committed() -> bool:
    """Whether a save may replace a committed checkpoint at its checkpoint_id when its storage writer was not told
    (DISTCKPT_OVERWRITE, default off). On, it restores DCP's behaviour for code that saves twice to one path;
    the old checkpoint still stays whole until the new one commits. A writer's ``overwrite=`` argument and
    CheckpointManager, which never replaces a step, are not affected."""
    return _bool("DISTCKPT_OVERWRITE", False)


def direct_io_mode() -> str:
    """Whether data files are written around the page cache with O_DIRECT (DISTCKPT_DIRECT_IO):
    ``auto`` (default) on Linux local disk file systems (ext4, xfs, btrfs, f2fs; not tmpfs, network
    or FUSE file systems), where each process learns per device whether direct or buffered writes move
    its files faster (backends/write_paths.py); ``on`` wherever the kernel takes it, ``off`` never. A
    file system that refuses it gets buffered writes. Direct writes skip the copy into the page cache and
    the writeback of dirty pages that a checkpoint, written once and fsynced, gains nothing from, and
    leave the page cache to the training job's own files (docs/performance.md has the figures)."""
    mode = os.environ.get("DISTCKPT_DIRECT_IO", "auto").strip().lower() or "auto"
    aliases = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}
    mode = aliases.get(mode, mode)
    if mode not in ("auto", "on", "off"):
        raise CheckpointError(f"DISTCKPT_DIRECT_IO={mode!r} is not one of auto, on, off")
    return mode


def direct_io_buffer_bytes() -> int:
    """Size of each page-aligned bounce buffer of a direct write (DISTCKPT_DIRECT_IO_BUFFER_BYTES,
    default 16 MiB, a multiple of 4 KiB). Each file being written has DISTCKPT_DIRECT_IO_QUEUE_DEPTH + 1
    (two by default), one filling while the others are written, smaller where they would not fit in
    the file's share of the memory budget; four files' worth stay allocated for the next save
    (touching fresh memory costs more than the copy). Writes of 8 MiB ran slower than 16 MiB ones on
    the development VM's disk (docs/performance.md)."""
    value = _int("DISTCKPT_DIRECT_IO_BUFFER_BYTES", 16 << 20, minimum=PAGE_BYTES)
    if value % PAGE_BYTES:
        raise CheckpointError(f"DISTCKPT_DIRECT_IO_BUFFER_BYTES={value} must be a multiple of {PAGE_BYTES}")
    return value


def direct_io_queue_depth() -> int:
    """Direct writes of one file in flight at once (DISTCKPT_DIRECT_IO_QUEUE_DEPTH, default 1):
    each holds a bounce buffer, and one more fills meanwhile. More keeps a device that needs a deep
    queue busy; on the development VM's disk, throttled or not, 2-8 gained nothing over 1
    (docs/performance.md, issue 45), so the default keeps a file's memory at two buffers."""
    return _int("DISTCKPT_DIRECT_IO_QUEUE_DEPTH", 1, minimum=1)


def direct_io_flush_threads() -> int:
    """Threads, shared by every direct write of a process, that write full bounce buffers while their
    writers fill the next (DISTCKPT_DIRECT_IO_FLUSH_THREADS, default 16). They only wait on the device;
    at most DISTCKPT_DIRECT_IO_QUEUE_DEPTH per file are busy at once. Read when the threads start."""
    return _int("DISTCKPT_DIRECT_IO_FLUSH_THREADS", 16, minimum=1)


def max_metadata_bytes() -> int:
    """Largest metadata document a reader accepts (DISTCKPT_MAX_METADATA_BYTES, default 1 GiB)."""
    return _int("DISTCKPT_MAX_METADATA_BYTES", 1 << 30, minimum=1024)


def max_header_bytes() -> int:
    """Largest data-file header a reader accepts (DISTCKPT_MAX_HEADER_BYTES, default 256 MiB)."""
    return _int("DISTCKPT_MAX_HEADER_BYTES", 256 << 20, minimum=1024)


def max_value_bytes() -> int:
    """Most bytes one value stored through a codec (a stream transform such as zstd) may decode to
    (DISTCKPT_MAX_VALUE_BYTES, default 1 GiB). The metadata does not record a value's decoded size, so
    without a cap a few kilobytes of stored bytes could decode to more memory than the host has; a reader
    decodes in pieces and stops with CorruptCheckpointError at the cap. Chunks of tensors are capped by
    their recorded dtype and sizes instead."""
    return _int("DISTCKPT_MAX_VALUE_BYTES", 1 << 30, minimum=1)


def collective_timeout_s() -> float:
    """Seconds a rank waits on the others in one checkpoint phase (DISTCKPT_TIMEOUT_S, default 600)."""
    return float(_int("DISTCKPT_TIMEOUT_S", 600, minimum=1))


def arrival_timeout_s() -> float:
    """Seconds a rank waits for every other rank of the group to call the same save or load, before any
    work (DISTCKPT_ARRIVAL_TIMEOUT_S, default 60; at most the collective timeout). A rank that calls
    save alone then gets an error naming the cause instead of waiting out the collective timeout."""
    return float(_int("DISTCKPT_ARRIVAL_TIMEOUT_S", 60, minimum=1))


def async_write_nice() -> int:
    """How much lower the CPU priority of async_save's background write is than the caller's
    (DISTCKPT_ASYNC_NICE, default 10, Linux; 0 keeps it equal). Training threads and the
    staging copy come first; the write takes what CPU they leave."""
    return _int("DISTCKPT_ASYNC_NICE", 10, minimum=0)


def allow_pickle_transport() -> bool:
    """Let planner/storage data that is not plain data travel between ranks pickled
    (DISTCKPT_ALLOW_PICKLE_TRANSPORT, default off). Only ranks of the same job see it."""
    return _bool("DISTCKPT_ALLOW_PICKLE_TRANSPORT", False)


def progress_mode() -> str:
    """How save and load report progress (DISTCKPT_PROGRESS): ``off`` (default), ``log`` (each
    rank logs bytes done and rate to the ``distckpt`` logger at INFO, every
    DISTCKPT_PROGRESS_EVERY_S seconds (5) while its data moves, and once at the end) or ``bar`` (a progress
    bar on standard error, on the coordinator rank; where standard error is not a terminal, the coordinator's
    lines of ``log`` instead)."""
    mode = os.environ.get("DISTCKPT_PROGRESS", "off").strip().lower() or "off"
    if mode not in ("off", "log", "bar"):
        raise CheckpointError(f"DISTCKPT_PROGRESS={mode!r} is not one of off, log, bar")
    return mode



def progress_log_every_s() -> float:
    """Seconds between two progress lines of a rank with ``DISTCKPT_PROGRESS=log``
    (DISTCKPT_PROGRESS_EVERY_S, default 5); the last line comes at the end whatever the interval."""
    return _float("DISTCKPT_PROGRESS_EVERY_S", 5.0, minimum=0.0)


def lease_stale_s() -> float:
    """Seconds after which a save's lease that was not renewed counts as its holder's death
    (DISTCKPT_LEASE_STALE_S, default 600). Only for holders on another host: on the same host
    a dead holder is known at once from its process. Also how old a staging area with no
    lease must be before it is removed. Keep it well above the renewal interval and any
    clock difference between hosts."""
    return float(_int("DISTCKPT_LEASE_STALE_S", 600, minimum=1))


def lease_renew_s() -> float:
    """Seconds between renewals of the leases this process holds on saves in flight
    (DISTCKPT_LEASE_RENEW_S, default 30)."""
    return float(_int("DISTCKPT_LEASE_RENEW_S", 30, minimum=1))


def s3_connect_timeout_s() -> float:
    """Seconds to wait for a connection to the S3 endpoint (DISTCKPT_S3_CONNECT_TIMEOUT_S, default 10)."""
    return float(_int("DISTCKPT_S3_CONNECT_TIMEOUT_S", 10, minimum=1))


def s3_read_timeout_s() -> float:
    """Seconds to wait for each answer (or the next bytes of one) from the S3 endpoint
    (DISTCKPT_S3_READ_TIMEOUT_S, default 20)."""
    return float(_int("DISTCKPT_S3_READ_TIMEOUT_S", 20, minimum=1))


def s3_max_attempts() -> int:
    """Attempts of each S3 request, the first included (DISTCKPT_S3_MAX_ATTEMPTS; default AWS_MAX_ATTEMPTS
    when that is set, else 3). With the timeouts above, a hung endpoint fails a request within about
    ``attempts * (connect or read timeout)`` seconds plus backoff."""
    aws = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    default = int(aws) if aws.isdigit() and int(aws) >= 1 else 3
    return _int("DISTCKPT_S3_MAX_ATTEMPTS", default, minimum=1)


def s3_deadline_s() -> float:
    """Seconds one save or one load may spend on S3 in all, cleanup included (DISTCKPT_S3_DEADLINE_S,
    default 0: no total limit, each request is still bounded by the timeouts and attempts). Past it no
    new request starts: the operation fails with StorageIOError, and what it leaves is removed later
    by the lease rules."""
    return float(_int("DISTCKPT_S3_DEADLINE_S", 0, minimum=0))


def tier_dir() -> str:
    """Where a node's memory tier lives (DISTCKPT_TIER_DIR; default ``/dev/shm/distckpt-tier-<uid>/<job>``, a tmpfs:
    memory that outlives a crashed training process but not the node). ``<job>`` is torchrun's run id
    (TORCHELASTIC_RUN_ID), else DISTCKPT_JOB_ID, else ``default``; the uid keeps users apart in the shared
    ``/dev/shm``. Inside it, each run (docs/tiers.md) has a directory of its own."""
    chosen = os.environ.get("DISTCKPT_TIER_DIR")
    if chosen:
        return chosen
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("DISTCKPT_JOB_ID") or "default"
    if "/" in job or job in (".", ".."):
        raise CheckpointError(f"the job id {job!r} (TORCHELASTIC_RUN_ID or DISTCKPT_JOB_ID) cannot name a folder; "
                              "give a plain name, or set DISTCKPT_TIER_DIR")
    return os.path.join("/dev/shm", f"distckpt-tier-{os.geteuid()}", job)


def node_id() -> str:
    """What identifies this process's node to the memory tier's placement (DISTCKPT_NODE_ID, else torchrun's
    GROUP_RANK, else the host name): replicas go to ranks of other nodes."""
    return os.environ.get("DISTCKPT_NODE_ID") or os.environ.get("GROUP_RANK") or os.uname().nodename


def tier_chunk_bytes() -> int:
    """Bytes of one message of the memory tier's transfers between nodes (DISTCKPT_TIER_CHUNK_BYTES, default 64 MiB):
    large enough that a message's overhead is lost in its bytes, small enough that three in flight per stream
    keep reading, sending and writing overlapped."""
    return _int("DISTCKPT_TIER_CHUNK_BYTES", 64 << 20, minimum=4096)


def tier_transfer_depth() -> int:
    """Messages in flight per stream of the memory tier's copying transfers (DISTCKPT_TIER_DEPTH, default 3): one
    being read, one sent, one written, each in a buffer of DISTCKPT_TIER_CHUNK_BYTES kept for the next transfer."""
    return _int("DISTCKPT_TIER_DEPTH", 3, minimum=1)


def hf_copy_block_bytes() -> int:
    """Bytes of host memory a Hugging Face publish copies a device or non-contiguous chunk through at a time
    (DISTCKPT_HF_COPY_BLOCK_BYTES, default 64 MiB); a row larger than this is copied whole."""
    return _int("DISTCKPT_HF_COPY_BLOCK_BYTES", 64 << 20, minimum=1)


def shared_reads() -> str:
    """When a load over a process group reads a stored chunk that several ranks need once, on one of them, which
    sends it to the others (DISTCKPT_SHARED_READS; engine/shared_reads.py): "auto" (the default) where the ranks
    that need it are on more than one node, or the store has no page cache on the node (an object store): ranks
    of one node reading one file fetch it from storage once anyway, and copying it between them costs more than
    reading it from memory; "on" (1, true, yes) wherever several ranks need it; "off" (0, false, no) never.
    A reader's ``shared_reads=`` overrides it; every rank must agree."""
    raw = os.environ.get("DISTCKPT_SHARED_READS", "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    return "on" if _bool("DISTCKPT_SHARED_READS", True) else "off"


def shared_read_bucket_bytes() -> int:
    """Largest buffer a shared read sends at once (DISTCKPT_SHARED_READ_BUCKET_BYTES; default 64 MiB, at most
    a quarter of the memory budget: a rank holds one it receives and two it reads ahead to send). A larger chunk
    is sent in pieces of whole rows; a row larger than this goes alone."""
    return _int("DISTCKPT_SHARED_READ_BUCKET_BYTES", max(1, min(64 << 20, memory_budget_bytes() // 4)), minimum=1)


def shared_read_min_bytes() -> int:
    """The fewest bytes a rank reads for the others in a shared read (DISTCKPT_SHARED_READ_MIN_BYTES; default 4 MiB):
    chunks that many ranks need but that come to less than this a rank are read by fewer ranks, so that a small
    state at thousands of ranks travels in a few messages, not one from every rank."""
    return _int("DISTCKPT_SHARED_READ_MIN_BYTES", 4 << 20, minimum=1)


def fsspec_options() -> dict:
    """fsspec's storage options for a save or load at an fsspec URL by ``checkpoint_id`` alone
    (DISTCKPT_FSSPEC_OPTIONS, a JSON object, default none: the filesystem's own configuration)."""
    raw = os.environ.get("DISTCKPT_FSSPEC_OPTIONS", "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"DISTCKPT_FSSPEC_OPTIONS is not JSON ({exc}); give a JSON object, as "
                              "'{\"anon\": false}'") from None
    if not isinstance(value, dict):
        raise CheckpointError("DISTCKPT_FSSPEC_OPTIONS must be a JSON object of fsspec storage options")
    return value

