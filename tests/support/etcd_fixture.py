"""pytest plugin: a real etcd server and real coordinator processes for tests.

List it in ``tests/conftest.py``: ``pytest_plugins = ["etcd_fixture"]``.

Fixtures:

* ``etcd_server`` (session): an :class:`EtcdServer` running the ``etcd`` binary on free
  loopback ports with a temporary data dir; ``.endpoint``, ``.stop()``, ``.start()``
  (same data dir and ports: an outage, not a wipe).  Tests are skipped when there is
  no ``etcd`` binary.
* ``etcd_prefix`` (function): a key prefix of its own for each test.
* ``etcd_config`` (function): an :class:`~pegaflow.config.EtcdConfig` for both, with a
  3 s lease TTL and 2 s call deadline; makes sure etcd is running.
* ``coordinators`` (function): a :class:`CoordinatorFactory`; ``await
  coordinators.start(etcd_config)`` runs ``python -m pegaflow.coordinator.main`` and
  returns a :class:`CoordinatorProcess` once it printed READY; all are killed after
  the test.

:func:`start_coordinator` / :func:`start_coordinator_async` do the same outside pytest
(benchmarks).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest

from pegaflow.config import EtcdConfig
from pegaflow.tools.devcluster import ETCD_BINARY, EtcdServer, token_env

REPO = Path(__file__).resolve().parents[2]


def make_test_certs(directory: Path) -> Path:
    """A throw-away CA, a server cert for 127.0.0.1 and a client cert (``openssl``)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def sh(*argv: str) -> None:
        subprocess.run(["openssl", *argv], cwd=d, check=True, capture_output=True, timeout=60)

    sh("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
       "-days", "1", "-subj", "/CN=pegaflow-test-ca")  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (d / f"{name}.ext").write_text(ext)
        key, csr, crt = f"{name}.key", f"{name}.csr", f"{name}.crt"
        sh("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
           "-subj", f"/CN={name}")  # fmt: skip
        sh("x509", "-req", "-in", csr, "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
           "-out", crt, "-days", "1", "-extfile", f"{name}.ext")  # fmt: skip
    return d


class CoordinatorProcess:
    """A ``pegaflow-coordinator`` subprocess; stdout and stderr are kept in ``log``."""

    _READY = re.compile(r"^READY (\S+) http=(-?\d+)")

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.popen = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=REPO,
        )
        self.log: list[str] = []
        #: ``host:port`` of the control protocol (after READY).
        self.address = ""
        #: HTTP port (after READY; -1 when off).
        self.http_port = -1
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            self.log.append(line)
            if len(self.log) > 5000:
                del self.log[:2500]
            m = self._READY.match(line)
            if m and not self._ready.is_set():
                self.address, self.http_port = m.group(1), int(m.group(2))
                self._ready.set()
        self._ready.set()

    @property
    def pid(self) -> int:
        """Process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.popen.poll() is None

    def _check_ready(self) -> None:
        if not self.address:
            self.kill()
            raise RuntimeError("coordinator exited before READY:\n" + self.tail())

    def wait_ready(self, timeout: float = 30.0) -> CoordinatorProcess:
        """Block until READY (raises RuntimeError with the log if it does not come)."""
        if not self._ready.wait(timeout):
            self.kill()
            raise RuntimeError(f"coordinator not READY in {timeout} s:\n" + self.tail())
        self._check_ready()
        return self

    async def wait_ready_async(self, timeout: float = 30.0) -> CoordinatorProcess:
        """:meth:`wait_ready` without blocking the event loop."""
        deadline = time.monotonic() + timeout
        while not self._ready.is_set():
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"coordinator not READY in {timeout} s:\n" + self.tail())
            await asyncio.sleep(0.02)
        self._check_ready()
        return self

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM (graceful stop), SIGKILL after ``timeout``; returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.alive():
            self.popen.kill()
        self.popen.wait(10)

    def tail(self, lines: int = 60) -> str:
        """The end of the process's output."""
        return "\n".join(self.log[-lines:])


def coordinator_argv(
    etcd: EtcdConfig | None,
    *,
    port: int = 0,
    http_port: int = 0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Command line of a coordinator on loopback (port 0: any free one)."""
    argv = [
        sys.executable, "-m", "pegaflow.coordinator.main",
        "--coordinator-host", "127.0.0.1",
        "--coordinator-port", str(port),
        "--coordinator-http-host", "127.0.0.1",
        "--coordinator-http-port", str(http_port),
    ]  # fmt: skip
    if etcd is not None and etcd.endpoints:
        argv += [
            "--etcd-endpoints", ",".join(etcd.endpoints),
            "--etcd-prefix", etcd.prefix,
            "--etcd-timeout-s", str(etcd.timeout_s),
        ]  # fmt: skip
    return argv + list(extra_args)


def start_coordinator(etcd: EtcdConfig | None, **kw: object) -> CoordinatorProcess:
    """Start a coordinator subprocess and block until it is READY."""
    timeout = float(kw.pop("timeout", 30.0))  # type: ignore[arg-type]
    env = token_env(kw.pop("token", None))  # type: ignore[arg-type]
    return CoordinatorProcess(coordinator_argv(etcd, **kw), env).wait_ready(timeout)  # type: ignore[arg-type]


async def start_coordinator_async(etcd: EtcdConfig | None, **kw: object) -> CoordinatorProcess:
    """Start a coordinator subprocess and wait (without blocking the loop) for READY."""
    timeout = float(kw.pop("timeout", 30.0))  # type: ignore[arg-type]
    env = token_env(kw.pop("token", None))  # type: ignore[arg-type]
    proc = CoordinatorProcess(coordinator_argv(etcd, **kw), env)  # type: ignore[arg-type]
    return await proc.wait_ready_async(timeout)


class CoordinatorFactory:
    """Starts coordinator processes for one test and kills them all afterwards."""

    def __init__(self) -> None:
        self.procs: list[CoordinatorProcess] = []

    async def start(
        self,
        etcd: EtcdConfig | None,
        *,
        token: str | None = None,
        tenants: str = "",
        port: int = 0,
        extra_args: Sequence[str] = (),
    ) -> CoordinatorProcess:
        """A READY coordinator on loopback."""
        proc = CoordinatorProcess(
            coordinator_argv(etcd, port=port, extra_args=extra_args),
            token_env(token, tenants=tenants),
        )
        self.procs.append(proc)
        return await proc.wait_ready_async()

    def cleanup(self) -> None:
        """Kill every process started."""
        for p in self.procs:
            p.kill()


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A real etcd for the whole session (see :class:`EtcdServer`)."""
    if shutil.which(ETCD_BINARY) is None:
        pytest.skip(f"no etcd binary ({ETCD_BINARY!r}); install etcd or set PEGAFLOW_TEST_ETCD")
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix unique to this test."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:60]
    return f"/pegaflow-test/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcd_config(etcd_server: EtcdServer, etcd_prefix: str) -> EtcdConfig:
    """An EtcdConfig for the session's etcd and this test's prefix (etcd is running)."""
    etcd_server.start()  # a no-op unless an earlier test left it stopped
    return EtcdConfig(
        endpoints=[etcd_server.endpoint],
        prefix=etcd_prefix,
        lease_ttl_s=3,
        timeout_s=2.0,
        batch_size=128,
        flush_interval_ms=2,
    )


@pytest.fixture
async def coordinators() -> AsyncIterator[CoordinatorFactory]:
    """Starts coordinator subprocesses; kills them after the test."""
    factory = CoordinatorFactory()
    try:
        yield factory
    finally:
        factory.cleanup()
