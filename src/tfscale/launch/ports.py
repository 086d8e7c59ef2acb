"""Ports for local workers: free ones picked by the kernel, or a checked range from a base."""

from __future__ import annotations

import contextlib
import socket

from tfscale.errors import LaunchError, explain

__all__ = ["check_ports", "free_ports"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``count`` distinct ports that were free on ``host`` a moment ago.

    Every socket stays bound until all are chosen, so the kernel cannot hand out one port
    twice. Another program may still take one before the worker binds it (an outgoing
    connection's ephemeral port: the job's own gRPC channels and every other job's open
    them all the time); that worker then exits with ``together.PORT_TAKEN_STATUS`` and the
    supervisor starts the job again on new ports without counting a restart.
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def check_ports(base: int, count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``base .. base+count-1`` after checking that each can be bound on ``host``.

    Raises:
        LaunchError: A port is out of range or already in use (it is named).
    """
    ports = list(range(base, base + count))
    if base < 1 or ports[-1] > 65535:
        raise LaunchError(
            explain(
                f"--port {base} with {count} tasks runs outside the port range.",
                received=f"ports {base}..{ports[-1]}",
                allowed="1..65535 (use >= 1024 without root)",
                fix="choose a lower --port, or leave it out to let tfscale pick free ports.",
            )
        )
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # Like gRPC's server, reuse ports in TIME_WAIT from a previous attempt; a port
            # with a live listener still fails to bind.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                sock.listen(1)
            except OSError as error:
                raise LaunchError(
                    explain(
                        f"Port {port} on {host} is already in use ({error.strerror}).",
                        received=f"--port {base} for {count} tasks: ports {base}..{ports[-1]}",
                        allowed=f"{count} consecutive free ports",
                        fix=f"pick another --port, free port {port}, or leave --port out "
                        "to let tfscale choose free ports.",
                    )
                ) from error
    return ports
