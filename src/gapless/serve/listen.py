"""The listening socket of `gapless serve`, bound before anything heavy is imported or loaded, so a
port in use is a one-line error at once. Standard library only."""

from __future__ import annotations

import errno
import socket

BACKLOG = 2048  # a burst of connections waits in the kernel instead of being reset (the old backlog was 5)


class PortInUse(OSError):
    """The address is taken or cannot be bound; the message says how to pick another."""


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} on {host} is in use; pick another with --port (0 picks a free one)") from None
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(BACKLOG)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
