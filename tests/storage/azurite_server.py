"""Azurite (Microsoft's Azure Storage emulator, from npm) on loopback, for the az:// tests. scripts/setup.sh installs
it with npm into the virtualenv (``<venv>/azurite``); where that was not run, the first test that needs it installs it
there the same way. Azurite keeps the service's preconditions that distckpt relies on: Put Blob and Put Block List
with ``If-None-Match: *`` onto an existing blob answer 409, a download with ``If-Match`` of a replaced blob 412."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

VERSION = "3.35.0"  # the Azurite tested
HOME = Path(os.environ.get("DISTCKPT_AZURITE_HOME") or Path(sys.prefix) / "azurite")
ACCOUNT = "devstoreaccount1"  # Azurite's well-known development account and key (public, in Azure's docs)
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "NO_PROXY", "no_proxy")


def executable() -> Optional[str]:
    local = HOME / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


def install() -> str:
    """Install Azurite with npm into HOME; the executable, or RuntimeError saying why it could not be installed."""
    found = executable()
    if found is not None:
        return found
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not installed (Azurite comes from npm; scripts/setup.sh installs it)")
    HOME.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([npm, "install", "--prefix", str(HOME), "--no-audit", "--no-fund", f"azurite@{VERSION}"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or executable() is None:
        raise RuntimeError(f"npm could not install azurite@{VERSION} into {HOME}: {out.stderr[-800:]}")
    return executable()


def connection_string(endpoint: str) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def azurite_server() -> Iterator[str]:
    """Start Azurite's blob service on 127.0.0.1 (a free port, blobs in memory), point the Azure environment at it
    (``AZURE_STORAGE_CONNECTION_STRING``) and yield its endpoint URL."""
    path = install()
    port = _free_port()
    proc = subprocess.Popen([path, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                             "--skipApiVersionCheck", "--disableTelemetry", "--silent"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ENV}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Azurite did not start on {endpoint}: {proc.stderr.read()[-500:]!r}") from None
                time.sleep(0.1)
        os.environ.pop("AZURE_STORAGE_ACCOUNT_NAME", None)
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(endpoint)
        for var in ("NO_PROXY", "no_proxy"):  # a proxy configured for the machine must not catch loopback
            os.environ[var] = ",".join(filter(None, [saved[var], "127.0.0.1", "localhost"]))
        yield endpoint
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


def new_container(service) -> str:
    name = f"distckpt-{uuid.uuid4().hex[:12]}"
    service.create_container(name)
    return name
