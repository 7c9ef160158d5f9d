"""A file descriptor handed from one process to the others of its host over a Unix socket.

The GPU driver exports shareable memory (Engram's host shards) as a POSIX file descriptor, which only
its process can use. Peers get a copy of it the way NCCL's proxies pass theirs: the owner listens on
an abstract Unix socket (no file on disk; gone with the socket) and sends the descriptor with
``SCM_RIGHTS`` to each peer that connects, and only to processes of its own user (``SO_PEERCRED``;
the name is visible in ``/proc/net/unix``, so the user is the guard, and an owner serves only
while its peers take the descriptor).
Unlike ``pidfd_getfd``, this needs no permission to trace the owner, which containers and Yama's
default (``kernel.yama.ptrace_scope=1``) deny. Both sides must be in one network namespace, as the
processes of one job on one host are.
"""
from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
from typing import Optional

__all__ = ["FdServer", "receive_fd", "socket_name", "new_token"]


def new_token() -> int:
    """A random positive int32 that, with the owner's process id and descriptor, names its socket (a
    process id alone may repeat across the PID namespaces of containers sharing one network)."""
    return secrets.randbits(31) or 1


def socket_name(pid: int, fd: int, token: int) -> bytes:
    """The abstract socket address a process ``pid`` serves its descriptor ``fd`` on."""
    return b"\0deep_ep-fd-%d-%d-%d" % (pid, fd, token)


def _peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


class FdServer:
    """Serves descriptor ``fd`` of this process on `socket_name(os.getpid(), fd, token)` until `close`:
    a daemon thread accepts each connection and sends the descriptor once.

    Raises:
        OSError: the socket could not be made (e.g. the name is taken).
    """

    def __init__(self, fd: int, token: int) -> None:
        self.fd, self.token = fd, token
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(socket_name(os.getpid(), fd, token))
            self._sock.listen(256)
        except BaseException:
            self._sock.close()
            raise
        self._uid = os.getuid()
        self._thread = threading.Thread(target=self._serve, args=(self._sock,), name=f"deep_ep-fd-{fd}",
                                        daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:   # closed
                return
            with conn:
                try:
                    if _peer_uid(conn) != self._uid:
                        continue   # another user's process gets nothing (it sees the connection close)
                    socket.send_fds(conn, [b"F"], [self.fd])
                except OSError:
                    continue   # that peer gave up; serve the next

    def close(self) -> None:
        """Stop serving (idempotent); the descriptor itself stays open."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept
        except OSError:
            pass
        sock.close()
        self._thread.join(timeout=5)


def receive_fd(pid: int, fd: int, token: int, timeout: Optional[float] = 30.0) -> int:
    """A descriptor of this process for process ``pid``'s descriptor ``fd``, served by its `FdServer`.

    Raises:
        OSError: no such server (ConnectionRefusedError / FileNotFoundError), a timeout, or a closed
            connection without a descriptor (e.g. the owner is another user's process).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_name(pid, fd, token))
        uid = _peer_uid(sock)
        if uid != os.getuid():   # a name taken by another user's process after the owner's closed
            raise OSError(f"the socket of process {pid}'s descriptor {fd} belongs to user {uid}, not this one")
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not fds:
        raise OSError(f"process {pid} closed the connection without sending its descriptor {fd}")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]
