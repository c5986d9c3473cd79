"""An lmrpc-server subprocess for the long-run scripts (bench/fuzz.py, bench/soak.py): started on a free loopback
port, its output kept (the server logs a line per request; an unread pipe would block it), stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ServerProcess:
    target: str  # host:port
    process: subprocess.Popen[str]  # the server
    output: list[str] = field(default_factory=list)  # its lines, as they come

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM, then wait; the exit code (killed after the timeout: -9)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def start(*args: str, timeout: float = 600) -> ServerProcess:
    """Start `python -m lmrpc.server --host 127.0.0.1 --port 0 ARGS`; return once it prints "ready"."""
    process = subprocess.Popen([sys.executable, "-m", "lmrpc.server", "--host", "127.0.0.1", "--port", "0", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    lines: list[str] = []
    target = ""
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        lines.append(line)
        if line.startswith("lmrpc-server listening on "):
            target = "127.0.0.1:" + line.rsplit(":", 1)[1].strip()
        if line.startswith("lmrpc-server ready") or time.monotonic() > deadline:
            break
    if not target or process.poll() is not None or not lines[-1].startswith("lmrpc-server ready"):
        process.kill()
        raise RuntimeError("lmrpc-server did not start:\n" + "".join(lines[-30:]))
    server = ServerProcess(target, process, lines)
    threading.Thread(target=lambda: server.output.extend(process.stdout or ()), daemon=True).start()
    return server


def resident_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
