"""Streamed weight pushes as a careless or hostile client sends them, over a raw socket (an HTTP
client would send them whole): a push that trickles its bucket in a byte at a time, and one that
announces a bucket larger than what it sends. `benchmarks/serve_probes` sends them beside a good
request, and `tests/serve/test_push_bodies.py` against the test server.

    sock = open_push(server.url, key)
    sock.sendall(chunk(LENGTH.pack(500 << 20) + bytes(1024)))  # announces 500 MB, sends 1 KiB
"""

from __future__ import annotations

import socket
import threading

from rollout.http.wire import FRAMES_MEDIA_TYPE, LENGTH, frame
from rollout.serve.routes import body_json


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of an HTTP chunked body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def open_push(url: str, key: str) -> socket.socket:
    """A streamed push's connection (to a server on loopback at `url`), its head and options frame
    sent; its bucket frames, if any, are the caller's to send."""
    port = int(url.rpartition(":")[2])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /update_weights_from_tensor HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        + f"Content-Type: {FRAMES_MEDIA_TYPE}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        + chunk(frame("update_weights", {"request": body_json("update_weights")}))
    )
    return sock


class TricklingPush(threading.Thread):
    """A push whose 1 MiB bucket comes a byte every `every_s` seconds (under --body-timeout-s, it is
    never stalled), from `start()` until `close()` or until the server cuts it off. `sock` is its
    connection, where the server's answer arrives."""

    def __init__(self, url: str, key: str, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.every_s = every_s
        self.sock = open_push(url, key)
        self.sock.sendall(chunk(LENGTH.pack(1 << 20)))
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.wait(self.every_s):
                self.sock.sendall(chunk(b"\0"))
        except OSError:  # cut off by the server (--upload-timeout-s, a shutdown): it holds nothing either
            return

    def close(self) -> None:
        """Stop sending and close the connection: the push is cut off before its end frame."""
        self.stop.set()
        self.join()
        self.sock.close()
