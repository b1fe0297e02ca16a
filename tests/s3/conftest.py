"""A moto S3 server on loopback for this folder's tests (one per test module) and a fresh bucket per
test, with the AWS environment (seen by spawned ranks too) pointing at it."""

import logging
import uuid

import pytest

from s3_helpers import client

moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def endpoint():
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # returns once the socket listens
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def bucket(endpoint, monkeypatch):
    """A fresh bucket; the AWS environment (seen by spawned ranks too) points at the server."""
    for name, value in (("AWS_ENDPOINT_URL", endpoint), ("AWS_ACCESS_KEY_ID", "testing"),
                        ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    try:  # fsspec keeps s3fs instances keyed by their arguments, not the environment: one made in an
        import s3fs  # earlier module (Lightning's ModelCheckpoint makes them) would ask that module's
        s3fs.S3FileSystem.clear_instance_cache()  # stopped server
    except ImportError:
        pass
    name = f"b-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name
