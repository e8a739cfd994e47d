"""A TCP proxy that delays every segment by a set one-way time: a link between machines,
made on loopback where ``tc netem`` is not available.

``python bench/delay_proxy.py --listen 127.0.0.1:0 --target 127.0.0.1:6379 --one-way-ms 0.25``
prints the port it listens on (one line), then forwards each connection to the target.
Each direction of each connection has a reader thread, which stamps every chunk it
receives with ``now + one_way`` and queues it, and a sender thread, which sleeps until
the stamp (``time.sleep``: clock_nanosleep, tens of microseconds precise, where an event
loop's epoll timeout would round up to a millisecond) and sends. So a request and its
answer each wait one one-way delay (a round trip costs ``2 x one_way``), a burst of
segments is delayed once, not once per segment, and bandwidth is not limited. Only for
loopback traffic of the benchmark's own servers; it stops with its parent (SIGTERM, or
stdin closed).
"""

from __future__ import annotations

import argparse
import collections
import socket
import sys
import threading
import time

CHUNK = 256 * 1024


class _Direction:
    """One direction of one connection: reader stamps and queues, sender waits and sends."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        self.src, self.dst, self.delay_s = src, dst, delay_s
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._send, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.src.recv(CHUNK)
            except OSError:
                data = b""
            with self.ready:
                self.queue.append((time.monotonic() + self.delay_s, data))
                self.ready.notify()
            if not data:
                return

    def _send(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                due, data = self.queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
            except OSError:
                for s in (self.src, self.dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return


def serve(listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
    server = socket.create_server(listen, backlog=4096)
    print(server.getsockname()[1], flush=True)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection(target)
        except OSError:
            client.close()
            continue
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _Direction(client, upstream, delay_s)
        _Direction(upstream, client, delay_s)


def _exit_with_parent() -> None:
    sys.stdin.read()  # EOF: the benchmark that started us is gone
    import os

    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--target", required=True)
    parser.add_argument("--one-way-ms", type=float, required=True)
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # a woken sender gets the GIL soon
    host, _, port = args.listen.rpartition(":")
    thost, _, tport = args.target.rpartition(":")
    serve((host, int(port)), (thost, int(tport)), args.one_way_ms / 1000)


if __name__ == "__main__":
    main()
