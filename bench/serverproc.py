"""Server subprocesses for the bench scripts: ServerProcess (output drained on a thread, its last lines kept for the
message when it dies); start(), an lmrpc-server on a free loopback port once it is ready (bench/fuzz.py, soak.py,
gateway.py, shapes.py, budgets.py, streaming.py), or lmrpc_server() and wait_listening for a caller that times its
start itself (bench/served.py); and the helpers around them: free_port, resident_bytes, running, stopped_on_error."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

TAIL_LINES = 40  # a server's last output lines kept for the message when it dies
LISTENING = "lmrpc-server listening on "  # lmrpc-server's line naming the port it bound (it is given --port 0)
READY = "lmrpc-server ready"  # lmrpc-server's line once it serves


class ServerDied(RuntimeError):
    """A server process exited while a script needed it; the message holds its last output lines."""


class ServerProcess:
    """A server subprocess whose output is drained on a thread (an unread pipe would fill and block the server),
    keeping the last lines for the error message if it dies, and the first line with each watched prefix."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, watch: Sequence[str] = (),
                 stop_timeout: float = 90.0) -> None:
        self.name = name  # what the messages call it: "lmrpc-server", "llama.cpp", ...
        self.argv = argv  # its command line
        self.target = ""  # host:port for clients, once known (start() and wait_listening set it)
        self.stop_timeout = stop_timeout  # seconds stop() waits after SIGTERM before SIGKILL
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)  # its last output lines
        self._watch = tuple(watch)  # line prefixes to report to wait_for_line (the listening port, ready)
        self._found: dict[str, str] = {}  # watched prefix -> the first line starting with it, stripped
        self._ended = False  # its output has ended: a waiter then finds the process dead
        self._changed = threading.Condition()  # signalled on a watched line and at the end of the output
        self.started = time.perf_counter()  # just before the process is created
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, errors="replace", env=env)
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.tail.append(line.rstrip("\n"))
            prefix = next((p for p in self._watch if p not in self._found and line.startswith(p)), None)
            if prefix is not None:
                with self._changed:
                    self._found[prefix] = line.strip()
                    self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        """The first output line starting with `prefix`, one of the constructor's `watch` prefixes."""
        if prefix not in self._watch:
            raise ValueError(f"{prefix!r} is not watched (watch={self._watch!r})")
        with self._changed:
            if not self._changed.wait_for(lambda: prefix in self._found or self._ended, timeout):
                raise TimeoutError(f"{self.name}: no line starting with {prefix!r} after {timeout:g} s")
        self.check_alive()
        if prefix not in self._found:
            raise self._died()
        return self._found[prefix]

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> float:
        """Poll `ready` every 50 ms until it holds; the seconds from the process's start. ServerDied if the process
        exits first; TimeoutError(`what` ...) once `timeout` seconds from its start have passed."""
        deadline = self.started + timeout
        while True:
            self.check_alive()
            if ready():
                return time.perf_counter() - self.started
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{what} after {timeout:g} s")
            time.sleep(0.05)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise self._died()

    def _died(self) -> ServerDied:
        self._drain.join(timeout=5)  # let the reader collect what the process printed last
        # Its output ends a moment before its exit is seen: wait for the status rather than report None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return ServerDied(f"{self.name} exited with status {self.process.returncode}; command: "
                          f"{shlex.join(self.argv)}\n  its last output lines:\n{lines}")

    def status_kib(self, field: str) -> int:
        """A field of /proc/PID/status in KiB (VmRSS: resident now; VmHWM: the peak); raises if the process died."""
        self.check_alive()
        found = _status_kib(self.pid, field)
        if found is not None:
            return found
        # A process that has just exited is a zombie without memory fields (or already gone)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self.check_alive()
        raise RuntimeError(f"no {field} in /proc/{self.pid}/status of a running process")

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM, then wait (`timeout`, default the constructor's stop_timeout); the exit code (killed after the
        timeout: -9). A process that has exited already just gives its code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=self.stop_timeout if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@contextlib.contextmanager
def running(servers: dict[str, ServerProcess]) -> Iterator[None]:
    """Stop every server started (those in `servers` when the block ends), whatever happens."""
    try:
        yield
    finally:
        for server in servers.values():
            server.stop()


@contextlib.contextmanager
def stopped_on_error(server: ServerProcess) -> Iterator[None]:
    """Stop a server whose start failed or was interrupted (Ctrl-C included), before the caller takes it over."""
    try:
        yield
    except BaseException:
        server.stop()
        raise


def free_port() -> int:
    """A free loopback port for a server that must be given one (lmrpc-server picks its own with --port 0). Another
    process could take it before the server binds it: then the server fails to start, with its message shown."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_kib(pid: int, field: str) -> int | None:
    """A field of /proc/PID/status in KiB; None when the process is gone or has no such field (a zombie)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def resident_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes (0 once it is gone)."""
    return (_status_kib(pid, "VmRSS") or 0) * 1024


def lmrpc_server(*args: str, name: str = "lmrpc-server", env: dict[str, str] | None = None,
                 stop_timeout: float = 90.0) -> ServerProcess:
    """Spawn `python -m lmrpc.server --host 127.0.0.1 --port 0 ARGS` (on loopback, on a port it picks) with `env`
    (default: this process's) and PYTHONUNBUFFERED=1, so that its lines come as printed; its LISTENING and READY lines
    watched. Returns at once: wait_listening (and wait_for_line(READY)) wait for it."""
    return ServerProcess(name, [sys.executable, "-m", "lmrpc.server", "--host", "127.0.0.1", "--port", "0", *args],
                         {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}, watch=(LISTENING, READY),
                         stop_timeout=stop_timeout)


def wait_listening(server: ServerProcess, timeout: float) -> str:
    """The host:port an lmrpc_server() listens on (from its LISTENING line), also set as server.target."""
    server.target = "127.0.0.1:" + server.wait_for_line(LISTENING, timeout).rsplit(":", 1)[1]
    return server.target


def start(*args: str, timeout: float = 600) -> ServerProcess:
    """Start `python -m lmrpc.server --host 127.0.0.1 --port 0 ARGS`; return once it prints "lmrpc-server ready"
    (ServerDied if it exits first, TimeoutError after `timeout` seconds; either way it is stopped)."""
    server = lmrpc_server(*args)
    with stopped_on_error(server):
        deadline = server.started + timeout
        wait_listening(server, timeout)
        server.wait_for_line(READY, max(0.0, deadline - time.perf_counter()))
    return server
