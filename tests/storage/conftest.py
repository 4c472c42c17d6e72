"""Fixtures of the object-store tests: a real S3-compatible server on loopback, a client and a bucket."""

import pytest

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
