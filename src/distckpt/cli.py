"""The ``distckpt`` command: inspect, verify, convert, list, compact and compare checkpoints.

\b
    distckpt inspect PATH [--json] [--storage-order]  keys (sorted), shapes, dtypes, chunks, files, sizes
    distckpt verify PATH [--quiet]     check every byte against its checksums
    distckpt convert --to FORMAT SRC DST      distckpt -> dcp | safetensors | torch-save | hf
    distckpt convert --from FORMAT SRC DST    dcp | safetensors | torch-save | hf -> distckpt (hf: DIR or its index)
    distckpt steps ROOT [--json] [--clean] [--watch]  a training run's committed steps; --clean removes crash leftovers
    distckpt compact STEP              make a step of an incremental run self-contained
    distckpt cat CKPT KEY [--json]     a value, or a tensor's summary (read chunk by chunk)
    distckpt diff A B [--json] [--exact]      keys added, removed, changed; which tensors differ

Exit codes: 0 success; 1 the checkpoint is damaged; 2 usage errors; 3 no checkpoint there (a wrong
path, an incomplete save, not a distckpt checkpoint; a run's root given to verify, a checkpoint given to
steps: the message names the command that takes it); 4 refused or failed otherwise (the destination
exists, an unsafe value, an unsupported input, a key the checkpoint lacks). diff: 0 the same, 1 they
differ, 5 one is damaged, the others as above.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import shlex
import sys
import time
from typing import Iterator, Optional

import click

import distckpt  # the package's API loads on first use: --help and --version import no torch

from . import __version__, knobs
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError


def _shown(text: str) -> str:
    """``text`` safe to print on a terminal: control characters (escape sequences, newlines) are escaped,
    so a key cannot forge lines or move the cursor. JSON output escapes them anyway."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _say_lines(head: str, text: str) -> None:
    """An error of several lines (a list of problems), each line made safe to print on its own."""
    lines = text.split("\n")
    click.echo(head + "\n".join(_shown(line) for line in lines), err=True)


DAMAGED, USAGE, NOT_FOUND, REFUSED = 1, 2, 3, 4
DIFF_DAMAGED = 5  # diff's 1 means "they differ"


def _code(exc: CheckpointError) -> int:
    """The exit code of a failure (module text)."""
    if isinstance(exc, CheckpointNotFoundError):
        return NOT_FOUND
    if isinstance(exc, (CorruptCheckpointError, FormatVersionError)):
        return DAMAGED
    return REFUSED


def _natural(key: str) -> tuple:
    """``key``'s place in a sorted listing: runs of digits compare by value, so ``layers.10`` follows ``layers.2``
    (the metadata stores whole tensors first, which puts an optimizer's step counters before a sharded model). A
    run compares by its length without leading zeros, then its digits: by value, at any length (int() refuses a
    run of over 4,300 digits)."""
    parts = re.split(r"([0-9]+)", key)
    return [(len(part.lstrip("0")), part.lstrip("0")) if i % 2 else part for i, part in enumerate(parts)], key


def _command(*words: str) -> str:
    """A command line to suggest: each path quoted as a shell needs it, and safe to print (:func:`_shown`)."""
    return _shown(" ".join(shlex.quote(w) for w in words))


def _human(n: int) -> str:
    """Bytes in decimal units (kB = 1000 B), the units of the progress bars."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


@click.group(help=__doc__)
@click.version_option(__version__, prog_name="distckpt")
def main() -> None:
    pass


@main.command()
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--storage-order", is_flag=True, help="keys in the order the metadata stores them, not sorted")
def inspect(checkpoint: str, as_json: bool, storage_order: bool) -> None:
    """Show what CHECKPOINT holds, from its metadata alone. Keys are sorted, runs of digits by their value
    (layers.2 before layers.10); --storage-order lists them as the metadata stores them."""
    try:
        md = distckpt.read_metadata(checkpoint)
    except CheckpointError as exc:
        click.echo(f"error: {_shown(str(exc))}", err=True)
        sys.exit(_code(exc))
    fsd = md.storage_data
    layout = getattr(fsd, "layout", None)  # another program's checkpoint (distckpt.layouts), or None: distckpt's
    rows = []
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, distckpt.TensorStorageMetadata):
            rows.append({"key": fqn, "kind": "tensor", "dtype": str(entry.properties.dtype).replace("torch.", ""),
                         "shape": list(entry.size), "chunks": len(entry.chunks)})
        else:
            rows.append({"key": fqn, "kind": "value"})
    if not storage_order:
        rows.sort(key=lambda row: _natural(row["key"]))
    files = {name: {"size": info.size, "rank": info.rank, **({"save_id": info.save_id} if getattr(info, "save_id", None) else {})}
             for name, info in getattr(fsd, "files", {}).items()}
    if as_json:
        click.echo(json.dumps({"checkpoint": checkpoint, "written_by": layout or "distckpt",
                               "format_version": md.version,
                               "save_id": getattr(fsd, "save_id", None), "keys": rows, "files": files}, indent=1))
        return
    total = sum(f["size"] for f in files.values() if "save_id" not in f)
    referenced_files = [f for f in files.values() if "save_id" in f]
    if layout == "DCP":
        click.echo(f"DCP checkpoint {_shown(checkpoint)} (written by torch.distributed.checkpoint, version {md.version}), "
                   f"{len(rows)} keys: distckpt.load reads it directly (resharding as for its own), and "
                   "`distckpt convert --from dcp SRC DST` makes a distckpt checkpoint of it")
    elif layout:
        click.echo(f"{layout} checkpoint {_shown(checkpoint)}, {len(rows)} keys, {len(files)} file(s), {_human(total)}: "
                   "distckpt.load reads it directly into any sharding")
    else:
        also = ""
        if referenced_files:
            stored = distckpt.stored_bytes.stored_bytes(md)
            also = (f"; {_human(stored.referenced)} of its items are in {len(referenced_files)} file(s) of earlier steps "
                    f"({_human(sum(f['size'] for f in referenced_files))} whole), which it references")
        click.echo(f"checkpoint {_shown(checkpoint)}: format {md.version}, save {_shown(str(getattr(fsd, 'save_id', '?')))}, "
                   f"{len(rows)} keys, {len(files) - len(referenced_files)} data file(s) of its own, {_human(total)}{also}")
    keys = [_shown(r["key"]) for r in rows]
    width = max([len(k) for k in keys] + [3])
    for key, r in zip(keys, rows):
        if r["kind"] == "tensor":
            click.echo(f"  {key:<{width}}  {r['dtype']:<9} {str(tuple(r['shape'])):<20} {r['chunks']} chunk(s)")
        else:
            click.echo(f"  {key:<{width}}  value")
    for name, f in sorted(files.items()):
        of = f", of save {_shown(f['save_id'])} (an earlier step's file this one references)" if "save_id" in f else ""
        click.echo(f"  file {_shown(name)}: {_human(f['size'])} from rank {f['rank']}{of}")


@main.command(name="verify")
@click.argument("checkpoint")
@click.option("--quiet", is_flag=True, help="print nothing; the exit code tells")
def verify_cmd(checkpoint: str, quiet: bool) -> None:
    """Check every byte of CHECKPOINT against its checksums, without loading it.

    A bar shows the progress on a terminal; DISTCKPT_PROGRESS=log or bar (off a terminal) prints lines instead."""
    progress = False if quiet else True if sys.stderr.isatty() else None
    try:
        with _progress_lines(not quiet):
            report = distckpt.verify(checkpoint, progress=progress)
    except CheckpointNotFoundError as exc:
        if not quiet:
            click.echo(f"incomplete or missing: {_shown(str(exc))}", err=True)
            run = _run_at(checkpoint)
            if run is not None:
                newest = run.all_steps()[-1]
                click.echo(f"{_shown(checkpoint)} is the root of a training run, not a checkpoint: "
                           f"`{_command('distckpt', 'steps', checkpoint)}` lists its steps; "
                           f"`{_command('distckpt', 'verify', run.path(newest))}` checks the newest", err=True)
        sys.exit(NOT_FOUND)
    except CheckpointError as exc:
        if not quiet:
            _say_lines(f"{'damaged' if _code(exc) == DAMAGED else 'error'}: ", str(exc))
        sys.exit(_code(exc))
    if quiet:
        return
    if report.checksums:
        click.echo(f"ok: {report.keys} keys in {report.files} file(s), {_human(report.bytes_checked)} checked against their checksums"
                   f"{_stored_text(report.stored)}")
    else:
        click.echo(f"ok: {report.keys} keys in {report.files} file(s): a {report.written_by} checkpoint, whose metadata and the "
                   f"place of every key in its files were checked; {report.written_by} records no checksums, so its bytes "
                   "cannot be (`distckpt convert --from ...` makes a distckpt copy that can)")


@contextlib.contextmanager
def _progress_lines(wanted: bool) -> Iterator[None]:
    """While a command runs, the progress lines DISTCKPT_PROGRESS asks for go to standard error: they are INFO
    records of the ``distckpt`` logger, which a command line's logging, unconfigured, would drop."""
    if not wanted or knobs.progress_mode() == "off":
        yield
        return
    logger = logging.getLogger("distckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run_at(path: str):
    """The CheckpointManager, read only, of the training run at ``path``; None where none of its steps committed
    (or it cannot be listed): a hint for a path given to the wrong command, never an error of its own."""
    if "://" not in path and not os.path.isdir(path):
        return None
    try:
        run = distckpt.CheckpointManager(path, cleanup=False, read_only=True)
        return run if run.all_steps() else None
    except (CheckpointError, OSError):
        return None


def _is_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a checkpoint (a committed one, of distckpt or of a program distckpt reads), even a
    damaged one: its metadata was found."""
    try:
        distckpt.read_metadata(path)
    except CheckpointNotFoundError:
        return False
    except CheckpointError:
        return True
    return True


_FORMATS = ("dcp", "safetensors", "torch-save", "hf")


def _stored_text(stored) -> str:
    """What an incremental or compressed checkpoint stores where: empty for one that is neither."""
    parts = []
    if stored.referenced:
        parts.append(f"{_human(stored.written)} written by this save, {_human(stored.referenced)} referenced in earlier steps")
    if stored.decoded != stored.stored:
        parts.append(f"compression ratio {stored.compression_ratio:.2f} ({_human(stored.decoded)} as loaded)")
    return "; " + "; ".join(parts) if parts else ""


def _stored_row(stored) -> dict:
    return {"written": stored.written, "referenced": stored.referenced, "decoded": stored.decoded,
            "compression_ratio": round(stored.compression_ratio, 4)}


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--from", "from_format", type=click.Choice(_FORMATS), help="SRC is in this format; DST becomes a distckpt checkpoint")
@click.option("--to", "to_format", type=click.Choice(_FORMATS), help="SRC is a distckpt checkpoint; DST becomes this format")
@click.option("--from-dcp", "from_dcp", is_flag=True, help="same as --from dcp")
@click.option("--to-dcp", "to_dcp", is_flag=True, help="same as --to dcp")
@click.option("--trust-pickle", is_flag=True,
              help="with --from dcp: SRC is trusted; metadata distckpt's unpickler refuses (a newer DCP) is read by DCP's own")
@click.option("--allow-pickle", is_flag=True, help="values that are not plain data may be stored / read pickled")
@click.option("--max-shard-size", default="5GB", show_default=True, help="with --to hf: tensor bytes per shard ('500MB', '2GiB')")
@click.option("--config", "config", default=None, help="with --to hf: a config.json (or a directory holding one) to copy in")
@click.option("--prefix", default=None, help="with --to hf: publish only the keys under this prefix, without it ('model.')")
def convert(src: str, dst: str, from_format: Optional[str], to_format: Optional[str], from_dcp: bool, to_dcp: bool,
            trust_pickle: bool, allow_pickle: bool, max_shard_size: str, config: Optional[str], prefix: Optional[str]) -> None:
    """Convert SRC into a new DST: distckpt <-> DCP directory, safetensors file, torch.save file, Hugging Face directory.

    Tensors come out whole, whatever sharding they were saved with. Conversions from and to Hugging Face
    directories read one tensor at a time (memory holds the tensors in flight, not the model). Examples:

    \b
      distckpt convert --to hf CKPT OUT_DIR --max-shard-size 2GB --config config.json --prefix model.
      distckpt convert --from hf HF_DIR CKPT
      distckpt convert --to safetensors CKPT model.safetensors
      distckpt convert --from torch-save model.pt CKPT
      distckpt convert --from dcp DCP_DIR CKPT
    """
    chosen = [("from", f) for f in [from_format, "dcp" if from_dcp else None] if f] + \
             [("to", f) for f in [to_format, "dcp" if to_dcp else None] if f]
    if len(chosen) != 1:
        click.echo("error: pass exactly one of --from FORMAT and --to FORMAT", err=True)
        sys.exit(USAGE)
    direction, fmt = chosen[0]
    say = (lambda text: click.echo(text, err=True))
    conversion = distckpt.convert
    try:
        if (direction, fmt) == ("from", "dcp"):
            n = conversion.from_dcp(src, dst, trust_pickle=trust_pickle, allow_pickle=allow_pickle, progress=say)
        elif (direction, fmt) == ("to", "dcp"):
            n = conversion.to_dcp(src, dst, allow_pickle=allow_pickle, progress=say)
        elif (direction, fmt) == ("from", "safetensors"):
            n = conversion.from_safetensors(src, dst, allow_pickle=allow_pickle, progress=say)
        elif (direction, fmt) == ("to", "hf"):
            n = conversion.to_hf(src, dst, max_shard_size=max_shard_size, config=config, prefix=prefix, progress=say)
        elif (direction, fmt) == ("from", "hf"):
            n = conversion.from_hf(src, dst, progress=say)
        elif (direction, fmt) == ("to", "safetensors"):
            n = conversion.to_safetensors(src, dst, allow_pickle=allow_pickle, progress=say)
        elif direction == "from":
            n = conversion.from_torch_save(src, dst, progress=say)
        else:
            n = conversion.to_torch_save(src, dst, allow_pickle=allow_pickle, progress=say)
    except CheckpointError as exc:
        click.echo(f"error: {_shown(str(exc))}", err=True)
        sys.exit(_code(exc))
    click.echo(f"ok: {n} keys converted into {dst}")



@main.command()
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--clean", is_flag=True, help="also remove what crashed saves and deletions left behind")
@click.option("--watch", is_flag=True, help="list again every --interval seconds, until interrupted (or --count times)")
@click.option("--interval", type=click.FloatRange(min=0.1, max=86400.0), default=5.0, show_default=True,
              help="seconds between lists")
@click.option("--count", type=click.IntRange(min=0), default=0, help="with --watch: stop after this many lists (0: never)")
def steps(root: str, as_json: bool, clean: bool, watch: bool, interval: float, count: int) -> None:
    """List the committed steps of the training run at ROOT (a CheckpointManager root).

    Each line shows a step, its checkpoint id and its size; a step whose
    metadata cannot be read is listed as damaged (and the exit code is 1).
    Saves that never committed are not steps; --clean removes their
    leftovers, only those of saves proven dead (safe beside a running trainer).
    ROOT that is a checkpoint (a step), not a run's root, exits with 3.
    --watch lists again and again, reading only the store (safe beside a
    running trainer): steps as they commit and go, their sizes, the run's.
    """
    if "://" not in root and not os.path.isdir(root):  # listing must not create the directory
        click.echo(f"error: {root!r} is not a directory", err=True)
        sys.exit(NOT_FOUND)
    if watch:
        if not math.isfinite(interval):
            raise click.BadParameter(f"{interval} is not a number of seconds", param_hint="--interval")
        sys.exit(_watch_steps(root, as_json, interval, count))
    try:
        mgr = distckpt.CheckpointManager(root, cleanup=False, read_only=True)
        if not mgr.all_steps() and _is_checkpoint(root):  # before --clean, which must never sweep inside a checkpoint
            _not_a_run(root)
        if clean:
            mgr = distckpt.CheckpointManager(root, cleanup=False)
        removed = mgr.remove_stale_temporaries() if clean else []
        rows, held = _step_rows(mgr)
    except CheckpointError as exc:
        click.echo(f"error: {_shown(str(exc))}", err=True)
        sys.exit(_code(exc))
    damaged = any("damaged" in r for r in rows)
    if as_json:
        click.echo(json.dumps({"root": root, "steps": rows, "removed": removed, "run_bytes": sum(held.values())}, indent=1))
        sys.exit(1 if damaged else 0)
    for path in removed:
        click.echo(f"removed leftover {_shown(path)}")
    if not rows:
        click.echo(f"no committed steps under {_shown(root)}")
        return
    _say_steps(rows, sum(held.values()))
    sys.exit(1 if damaged else 0)


def _watch_steps(root: str, as_json: bool, interval: float, count: int) -> int:
    """``steps --watch``: the run's steps listed every ``interval`` seconds (a screen redrawn on a terminal, a list
    after a time stamp otherwise, a JSON document a line with --json); a store that fails one listing is said, and
    the next is tried. Returns the exit code of the last listing (1: a step in it is damaged), as ``steps`` does."""
    listed, damaged = 0, False
    redraw = sys.stdout.isatty() and not as_json
    try:
        while True:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            try:
                mgr = distckpt.CheckpointManager(root, cleanup=False, read_only=True)
                if listed == 0 and not mgr.all_steps() and _is_checkpoint(root):
                    _not_a_run(root)  # a checkpoint, not a run: exits as `steps` does
                rows, held = _step_rows(mgr)
                failure = None
            except (CheckpointError, OSError) as exc:  # the root gone or replaced meanwhile: said, and tried again
                rows, held, failure = [], {}, _shown(str(exc))
            damaged = any("damaged" in r for r in rows)
            if as_json:
                click.echo(json.dumps({"time": stamp, "root": root, "steps": rows, "run_bytes": sum(held.values()),
                                       "error": failure}))
            else:
                click.echo(("\x1b[H\x1b[2J" if redraw else "") + f"{stamp}  {_shown(root)}")
                if failure is not None:
                    click.echo(f"error: {failure}")
                elif rows:
                    _say_steps(rows, sum(held.values()))
                else:
                    click.echo("no committed steps yet")
            listed += 1
            if count and listed >= count:
                return 1 if damaged else 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 1 if damaged else 0


def _not_a_run(root: str) -> None:
    """``steps`` given a checkpoint: say which commands take one, and the run it is a step of, if it is one."""
    local = "://" not in root
    parent = os.path.dirname(os.path.abspath(root) if local else root.rstrip("/"))  # a step named from inside its run
    run = _run_at(parent) if parent else None
    of = f"; `{_command('distckpt', 'steps', parent)}` lists the run it is a step of" if run is not None else ""
    click.echo(f"error: {_shown(root)} is a checkpoint, not the root of a training run: "
               f"`{_command('distckpt', 'verify', root)}` checks it, `{_command('distckpt', 'inspect', root)}` lists "
               f"its keys{of}", err=True)
    sys.exit(NOT_FOUND)


def _step_rows(mgr) -> tuple[list, dict]:
    """A row per committed step of ``mgr``'s run, and the size of each data file its steps store or reference."""
    rows = []
    held: dict = {}  # (checkpoint, save id, file) -> size: each data file the run's steps store or reference, once
    for step in mgr.all_steps():
        try:
            md = distckpt.read_metadata(mgr.path(step))
        except CheckpointError as exc:  # one damaged step hides none of the others
            rows.append({"step": step, "checkpoint": mgr.path(step), "damaged": str(exc)})
            continue
        fsd = md.storage_data
        files = getattr(fsd, "files", {})
        own = {name: f.size for name, f in files.items() if getattr(f, "save_id", None) is None}
        for name, f in files.items():
            if getattr(f, "save_id", None):  # "<checkpoint>/<file>", as the metadata's parser checked it
                checkpoint, _, file = name.partition("/")
                key = (checkpoint, f.save_id, file)
            else:
                key = (mgr._name(step), getattr(fsd, "save_id", None), name)
            held[key] = f.size
        rows.append({"step": step, "checkpoint": mgr.path(step), "bytes": sum(own.values()),
                     "files_referenced": sum(f.size for n, f in files.items() if n not in own),
                     "keys": len(md.state_dict_metadata), **_stored_row(distckpt.stored_bytes.stored_bytes(md))})
    return rows, held


def _say_steps(rows: list, run_bytes: int) -> None:
    for r in rows:
        newest = "  (newest)" if r is rows[-1] else ""
        if "damaged" in r:
            click.echo(f"step {r['step']:>10}  {'DAMAGED':>10}  {_shown(r['damaged'])}  {_shown(r['checkpoint'])}{newest}")
        else:
            extra = ""
            if r["referenced"]:
                extra += f"  written {_human(r['written'])}, referenced {_human(r['referenced'])}"
            if r["decoded"] != r["written"] + r["referenced"]:
                extra += f"  compression {r['compression_ratio']:.2f}x"
            click.echo(f"step {r['step']:>10}  {_human(r['bytes']):>10}  {r['keys']} key(s){extra}  {_shown(r['checkpoint'])}{newest}")
    if any(r.get("files_referenced") for r in rows):
        click.echo(f"each step's size is its own data files; the run's {len(rows)} step(s) hold {_human(run_bytes)} of data "
                   "files on the store, with the files of deleted steps they still reference")


@main.command(name="compact")
@click.argument("checkpoint")
def compact_cmd(checkpoint: str) -> None:
    """Make CHECKPOINT, a step of an incremental run, self-contained: copy in the data files it references in
    earlier steps, then commit it referencing none (the run's next retention removes what nothing references)."""
    try:
        report = distckpt.compaction.compact(checkpoint)
    except CheckpointError as exc:
        _say_lines("error: ", str(exc))
        sys.exit(_code(exc))
    if report.files:
        click.echo(f"copied {report.files} referenced file(s), {_human(report.bytes_copied)}, into {_shown(checkpoint)}")
    else:
        click.echo(f"{_shown(checkpoint)} references no other checkpoint: nothing to do")


@main.command()
@click.argument("checkpoint")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def cat(checkpoint: str, key: str, as_json: bool) -> None:
    """Print KEY of CHECKPOINT: a value, or a tensor's summary (dtype, shape, first elements; min, max, mean and
    norm of a float tensor), read chunk by chunk within the memory budget, every chunk checked."""
    try:
        with distckpt.open(checkpoint) as ckpt:
            item = ckpt[key]
            if isinstance(item, distckpt.opening.LazyTensor):
                doc = distckpt.opening.summarize(item)
            else:
                doc = {"key": key, "kind": "value", "value": item}
    except CheckpointError as exc:
        click.echo(f"error: {_shown(str(exc))}", err=True)
        sys.exit(_code(exc))
    if as_json:
        if doc["kind"] == "value":
            doc["value"] = _jsonable(doc["value"])
        click.echo(json.dumps(doc, indent=1, allow_nan=False))
    elif doc["kind"] == "value":
        value = doc["value"]
        click.echo(_shown(f"BytesIO({value.getvalue()!r})" if isinstance(value, io.BytesIO) else repr(value)))
    else:
        click.echo(f"{_shown(key)}: tensor {doc['dtype']} {doc['shape']}, {doc['chunks']} chunk(s)")
        for name in ("min", "max", "mean", "norm", "nan"):
            if name in doc:
                click.echo(f"  {name:<5} {doc[name]}")
        click.echo(f"  head  {doc['head']}")


def _jsonable(x):
    """A value as strict JSON holds it: NaN and infinities as text, tuples as lists, a dict with keys other than
    strings as a list of [key, value] pairs (JSON would make 1 and "1" one key, and cannot take a tuple), bytes
    and the rest by their repr."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _jsonable(v) for k, v in x.items()}
        return [[_jsonable(k), _jsonable(v)] for k, v in x.items()]
    if isinstance(x, io.BytesIO):
        return repr(x.getvalue())
    return repr(x)


@main.command(name="diff")
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (with the bytes read from each side)")
@click.option("--exact", is_flag=True, help="read the bytes of tensors whose checksums agree, to confirm")
def diff_cmd(a: str, b: str, as_json: bool, exact: bool) -> None:
    """Compare checkpoints A and B: keys added or removed, changes of kind, shape or dtype, and which tensors and
    values differ. Tensors stored alike are compared by checksum first, reading nothing; the rest by their
    bytes, streamed within the memory budget (checkpoints saved at different world sizes compare too).

    Exit code 0: the same; 1: they differ; 5: one is damaged; 2, 3, 4 as for the other commands."""
    try:
        report = distckpt.diffing.diff(a, b, exact=exact)
    except CheckpointError as exc:
        click.echo(f"error: {_shown(str(exc))}", err=True)
        code = _code(exc)
        sys.exit(DIFF_DAMAGED if code == DAMAGED else code)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1))
    else:
        _say_diff(report)
    sys.exit(0 if report.identical else 1)


def _say_diff(report) -> None:
    click.echo(f"--- {_shown(report.a)}\n+++ {_shown(report.b)}")
    for key in report.removed:
        click.echo(f"- {_shown(key)}")
    for key in report.added:
        click.echo(f"+ {_shown(key)}")
    for change in report.changed:
        sides = [", ".join(f"{k} {v}" for k, v in change[side].items()) for side in ("a", "b")]
        click.echo(f"~ {_shown(change['key'])}: {sides[0]} -> {sides[1]}")
    for entry in report.differ:
        count = f", {entry['elements']} element(s)" if "elements" in entry else ""
        click.echo(f"! {_shown(entry['key'])} differs (by {entry['decided_by']}{count})")
    by_sum = sum(1 for entry in report.same if entry["decided_by"] == "checksum")
    note = f", {by_sum} of them by checksum only (--exact reads their bytes)" if by_sum else ""
    read = report.bytes_read
    click.echo(f"{len(report.same)} key(s) the same{note}; {_human(read.get('a', 0))} and {_human(read.get('b', 0))} read")
    click.echo("the same" if report.identical else "they differ")


if __name__ == "__main__":  # pragma: no cover
    main()
