"""``free_port`` picks ports the kernel does not hand out to outgoing connections.

The embedded servers come back on their port after a restart (the URLs handed out stay
valid); a port from the ephemeral range could meanwhile become the local port of any
client connection, the ones reconnecting to that server among them.
"""

from __future__ import annotations

import socket

from services.runtime.ops.embedded import EPHEMERAL_RANGE, free_port


def _ephemeral_low() -> int:
    return int(EPHEMERAL_RANGE.read_text().split()[0])


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low = _ephemeral_low()
    assert low > 2048, "this machine leaves no room below its ephemeral range"
    for _ in range(20):
        port = free_port()
        assert 1024 < port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_the_ports_asked_for_beside_it_are_free_and_below_the_range_too() -> None:
    low = _ephemeral_low()
    port = free_port(also=(2,))
    assert port + 2 < low
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", port))
        second.bind(("127.0.0.1", port + 2))


def test_a_port_in_use_is_not_given() -> None:
    low = _ephemeral_low()
    taken = []
    try:
        # hold a few hundred ports of the range it draws from: none of them comes back
        for port in range(low - 300, low):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            taken.append(sock)
        held = {s.getsockname()[1] for s in taken}
        assert all(free_port() not in held for _ in range(50))
    finally:
        for sock in taken:
            sock.close()
