"""Free loopback ports for local servers (MinIO, moto, PostgreSQL).

A *free port* is one the kernel handed out for ``127.0.0.1:0`` a moment ago. It is released
before the server binds it, so another process can take it in between: servers that fail to
bind should be retried on a new port rather than trusted to win the race.
"""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing was listening on when this returned."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
