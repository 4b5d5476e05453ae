"""The uid of whoever is at the other end of a Unix socket connection, for the app: uvicorn's
HTTP protocol, with the peer's credentials (SO_PEERCRED, from the kernel) added to the state
each request of the connection carries (``request.state``). A TCP connection has none, and no
request can set it: it is not a header."""

from __future__ import annotations

import asyncio
import socket
import struct

from uvicorn.protocols.http.h11_impl import H11Protocol

PEER_UID = "oomguard_peer_uid"
_UCRED = struct.Struct("3i")  # pid, uid, gid


class PeerCredentialsProtocol(H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            # A copy per connection: the server's state dict is shared by every connection.
            self.app_state = {**self.app_state, PEER_UID: uid}
