"""`deep_ep.comm.fd_share`: a descriptor served over an abstract Unix socket reaches other processes
of the same user (Engram's host shards across processes use it), without any permission to trace
the owner; a wrong name is refused at once; closing stops the serving, not the descriptor."""
import multiprocessing as mp
import os

import pytest

from deep_ep.comm import fd_share

PAYLOAD = b"deep_ep shard bytes " * 100


def _reader(pid, fd, token, queue):
    try:
        local = fd_share.receive_fd(pid, fd, token, timeout=10)
        try:
            queue.put(os.pread(local, len(PAYLOAD), 0))
        finally:
            os.close(local)
    except Exception as exc:   # noqa: BLE001 - reported to the test
        queue.put(f"{type(exc).__name__}: {exc}")


def test_a_served_descriptor_reaches_other_processes():
    fd = os.memfd_create("deep_ep-test")
    os.write(fd, PAYLOAD)
    token = fd_share.new_token()
    server = fd_share.FdServer(fd, token)
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        readers = [ctx.Process(target=_reader, args=(os.getpid(), fd, token, queue)) for _ in range(3)]
        for reader in readers:
            reader.start()
        got = [queue.get(timeout=60) for _ in readers]
        for reader in readers:
            reader.join(timeout=30)
        assert got == [PAYLOAD] * 3
        with pytest.raises(OSError):   # another token names no server
            fd_share.receive_fd(os.getpid(), fd, token + 1 if token < 2 ** 31 - 1 else 1, timeout=5)
    finally:
        server.close()
        server.close()   # idempotent
    os.fstat(fd)         # the descriptor itself stays open
    with pytest.raises(OSError):
        fd_share.receive_fd(os.getpid(), fd, token, timeout=5)
    os.close(fd)
