"""A real S3-compatible HTTP server (moto's) on loopback, for the object-store tests."""

from __future__ import annotations

import logging
import os
import uuid
from contextlib import contextmanager
from typing import Iterator

ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_DEFAULT_REGION",
       "NO_PROXY", "no_proxy")


@contextmanager
def s3_server(ip_address: str = "127.0.0.1") -> Iterator[str]:
    """Start the server on ``ip_address`` (loopback, or the bridge address of a cluster the test made; a free
    port) and point the AWS environment at it; yield the endpoint.

    Processes spawned while it runs (the ranks of multi-rank tests) inherit the environment.
    """
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address=ip_address, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update({"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "distckpt-test",
                       "AWS_SECRET_ACCESS_KEY": "distckpt-test", "AWS_REGION": "us-east-1",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    for var in ("NO_PROXY", "no_proxy"):  # a proxy configured for the machine must not catch loopback
        os.environ[var] = ",".join(filter(None, [saved[var], "127.0.0.1", "localhost", ip_address]))
    try:
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def new_bucket(client) -> str:
    name = f"distckpt-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return name
