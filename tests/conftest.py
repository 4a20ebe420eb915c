import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from shardpoint.demo.cluster import wait_for_s3_server
from tests.distributed import free_port

#: the suite must finish in under 20 minutes on 2 cores: longer variants are marked ``long``
LONG_RUN = os.environ.get("SHARDPOINT_LONG") == "1"


def pytest_collection_modifyitems(config, items):
    """Skip the ``long`` variants unless ``SHARDPOINT_LONG=1`` asks for them."""
    if LONG_RUN:
        return
    skip = pytest.mark.skip(reason="a longer variant: SHARDPOINT_LONG=1 runs it")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_torch_warnings():
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    torch.set_num_threads(1)


class Gate:
    """A TCP proxy on 127.0.0.1 in front of a server, which can be closed and reopened.

    Closing it refuses new connections and resets open ones, as a server that went
    down would, while the server behind it keeps its state for when it "comes back".
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.open()

    def open(self):
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener.settimeout(0.2)
        self._running = True
        self._acceptor = threading.Thread(target=self._accept, args=(self._listener,), daemon=True)
        self._acceptor.start()

    def close(self):
        self._running = False
        self._acceptor.join()
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
            self._conns.clear()

    def _accept(self, listener: socket.socket):
        while self._running:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class S3Server:
    """A real S3-compatible server (moto_server) on 127.0.0.1, its endpoint in the standard AWS variables.

    Clients reach it through a :class:`Gate`, so tests can take the endpoint down and bring it back.
    """

    scheme = "s3"

    def __init__(self):
        self.server_port = free_port()
        self.port = self.server_port
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "SHARDPOINT_S3_TIMEOUT": "2",
            "SHARDPOINT_S3_RETRIES": "2",
            "SHARDPOINT_OBJECT_RETRIES": "2",
            "SHARDPOINT_OBJECT_BACKOFF": "0.2",
        }
        moto = Path(sys.executable).with_name("moto_server")
        self.process = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.server_port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_s3_server(self.server_port, self.process)
        self.gate = Gate(self.server_port)
        self.port = self.gate.port
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env["AWS_ENDPOINT_URL"] = self.endpoint

    def make_bucket(self, name: str) -> str:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
        return f"s3://{name}"

    def pause(self):
        """The endpoint goes down: connections are refused and open ones reset."""
        self.gate.close()

    def resume(self):
        self.gate.open()

    def stop(self):
        self.gate.close()
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="session")
def s3_server():
    yield from _serve(S3Server())


@pytest.fixture
def bucket(s3_server, request):
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    return s3_server.make_bucket(name)


def _serve(server):
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def gs_server():
    from tests.cloud_servers import GcsServer

    yield from _serve(GcsServer(Gate))


@pytest.fixture(scope="session")
def az_server():
    from tests.cloud_servers import AzureServer

    yield from _serve(AzureServer(Gate))


@pytest.fixture(params=["s3", "gs", "az"])
def cloud(request):
    """The S3, GCS and Azure emulators: a test using it runs on all three stores."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture
def cloud_bucket(cloud, request):
    """A fresh bucket (GCS) or container (Azure) for this test: ``gs://name`` or ``az://name``."""
    import hashlib

    words = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    return cloud.make_bucket(f"t-{words}-{digest}".replace("--", "-"))
