"""nginx in front of two lmrpc-server replicas (grpc_pass to an upstream of both, HTTP/2 cleartext listener):
streaming calls spread over both replicas, request metadata passes through, and a client's cancel through nginx
frees the request on the replica that ran it.

nginx comes from Debian's nginx-light; scripts/test.sh installs it in CI. Outside CI the module is skipped
without it. nginx runs in the foreground as one process, with its config, logs and temp dirs under tmp.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from lmrpc.client import Client, FinishReason, LmrpcError

if TYPE_CHECKING:
    from tests.e2e.conftest import RunningServer

pytestmark = pytest.mark.e2e

PROMPT = "Count from one to one thousand:"
LONG = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}  # runs for minutes unless stopped
CALLS = 20

NGINX_CONF = """\
daemon off;
master_process off;  # one foreground process, as the invoking user: nothing to reap, no privilege switch
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream lmrpc {{
        server {a};
        server {b};
    }}
    server {{
        listen 127.0.0.1:{port} http2;
        location / {{
            grpc_pass grpc://lmrpc;
            # Between two messages of a stream; the default 60 s would cut a slow generation.
            grpc_read_timeout 600s;
            grpc_send_timeout 600s;
        }}
    }}
}}
"""


def nginx_binary() -> str:
    """nginx on PATH or in /usr/sbin (not on a non-root PATH); in CI it must be there, elsewhere skip."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("nginx is not installed; scripts/test.sh installs Debian's nginx-light when CI is set")
    pytest.skip("nginx is not installed (apt-get install nginx-light); CI installs it and runs this test")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def replicas(launch_server: Callable[..., RunningServer]) -> Iterator[tuple[RunningServer, RunningServer]]:
    nginx_binary()  # skip (or fail in CI) before spending a minute on the replicas
    args = ("--kv-cache-tokens", "8192", "--sampling-defaults", "openai", "--drain-delay", "0")
    with ThreadPoolExecutor(2) as pool:  # the two load their model at the same time
        started = [pool.submit(launch_server, *args) for _ in range(2)]
        servers = [f.result() for f in started]
    yield servers[0], servers[1]
    for s in servers:
        s.process.send_signal(signal.SIGTERM)
    for s in servers:
        try:
            s.process.wait(timeout=60)
        finally:
            if s.process.poll() is None:
                s.process.kill()


@pytest.fixture(scope="module")
def nginx(replicas: tuple[RunningServer, RunningServer], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("nginx")
    port = _free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, a=replicas[0].target, b=replicas[1].target))
    log = (tmp / "stderr.log").open("w")
    # -e: nginx opens its compiled-in error log (/var/log/nginx) before reading the config otherwise.
    process = subprocess.Popen([nginx_binary(), "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"nginx exited {process.returncode}: {_logs(tmp)}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not listen on {port}: {_logs(tmp)}") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()  # SIGTERM: fast shutdown
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _logs(tmp: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in (tmp / "stderr.log", tmp / "error.log")
                     if p.exists())


def _is_live(replica: Client, rid: str) -> bool:
    """Whether `rid` is running on `replica`, without disturbing it: a Generate reusing a live rid is refused."""
    try:
        replica.generate("probe", sampling_params={"max_new_tokens": 1}, rid=rid)
    except LmrpcError as e:
        if e.code == grpc.StatusCode.INVALID_ARGUMENT and any(
                "already running" in v.description for v in e.field_violations):
            return True
        raise
    return False


def test_streams_spread_over_both_replicas(nginx: str, replicas: tuple[RunningServer, RunningServer]) -> None:
    served = {r.target: 0 for r in replicas}
    with Client(nginx, timeout=120) as front, Client(replicas[0].target, timeout=30) as a, \
            Client(replicas[1].target, timeout=30) as b:
        for i in range(CALLS):
            rid = f"spread-{uuid.uuid4().hex[:8]}-{i}"
            # The rid travels as x-request-id metadata, which nginx must pass on.
            stream = front.generate(PROMPT, sampling_params=LONG, stream=True, metadata=[("x-request-id", rid)])
            first = next(stream)
            assert first.rid == rid and first.finish is None
            # Exactly one replica is running it: the one nginx chose. Abort ends it there (and tells us which).
            ran_it = [r.target for r, c in zip(replicas, (a, b), strict=True) if c.abort(rid) == [rid]]
            assert len(ran_it) == 1, (rid, ran_it)
            served[ran_it[0]] += 1
            rest = list(stream)
            assert rest and rest[-1].finish is not None and rest[-1].finish.reason is FinishReason.ABORT
    assert sum(served.values()) == CALLS
    assert all(count > 0 for count in served.values()), served  # nginx balances per call over its upstream


def test_cancel_through_nginx_frees_the_request(nginx: str, replicas: tuple[RunningServer, RunningServer]) -> None:
    rid = f"cancel-{uuid.uuid4().hex[:8]}"
    with Client(nginx, timeout=300) as front, Client(replicas[0].target, timeout=30) as a, \
            Client(replicas[1].target, timeout=30) as b:
        stream = front.generate(PROMPT, sampling_params=LONG, rid=rid, stream=True)
        assert next(stream).rid == rid
        running_on = [c for c in (a, b) if _is_live(c, rid)]
        assert len(running_on) == 1
        replica = running_on[0]
        try:
            stream.close()  # cancels the call: RST_STREAM to nginx, which gives up its upstream stream
            deadline = time.monotonic() + 10
            while _is_live(replica, rid):
                assert time.monotonic() < deadline, "the replica still runs the request 10 s after the cancel"
                time.sleep(0.1)
        finally:
            replica.abort(rid)  # if the assertion failed: do not leave a 2000-token generation running
