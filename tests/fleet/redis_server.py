"""A real ``redis-server`` for the tests: a free port, no persistence, stop and start at will.

Redis cannot listen on port 0, so a free port is found by binding a socket
first.  Where ``redis-server`` (or, for TLS, ``openssl``) is missing the
tests skip with a loud reason, except under CI (``CI=true``), where they
fail: .ci/run installs both.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

REDIS = shutil.which("redis-server")
OPENSSL = shutil.which("openssl")
START_TIMEOUT_S = 10.0


def require(tool: str | None, name: str) -> str:
    """The tool's path; skip loudly without it, or fail under CI."""
    if tool is not None:
        return tool
    message = f"{name} is not installed: THE REDIS TESTS DID NOT RUN (apt-get install {name})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1; ``stop()`` / ``start()`` keep the port."""

    def __init__(
        self, workdir: Path, *, password: str | None = None, tls: tuple[Path, Path] | None = None
    ) -> None:
        self.binary = require(REDIS, "redis-server")
        self.workdir = workdir
        self.password = password
        self.tls = tls
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        auth = f":{self.password}@" if self.password else ""
        query = f"?ssl_ca_certs={self.tls[0]}" if self.tls else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0{query}"

    def _arguments(self) -> list[str]:
        args = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.workdir)]
        if self.tls:
            cert, key = self.tls
            args += ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
            args += ["--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args

    def start(self) -> None:
        self.process = subprocess.Popen(
            self._arguments(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + START_TIMEOUT_S  # noqa: TID251 - a synchronous fixture
        while time.monotonic() < deadline:  # noqa: TID251
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.02)  # noqa: TID251
        raise RuntimeError("redis-server did not start listening")

    def stop(self) -> None:
        """Kill it at once (SIGKILL), as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: it keeps its connections but answers nothing (a slow Redis)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


def make_certificate(workdir: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (cert, key), made with openssl."""
    openssl = require(OPENSSL, "openssl")
    cert, key = workdir / "redis.crt", workdir / "redis.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
