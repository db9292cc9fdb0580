"""A chunked request body (HTTP/1.1 chunked transfer coding, RFC 9112 section 7.1) whose data is a
stream of frames (`rollout.http.frame_views`), decoded as the socket delivers it: each chunk's data is
read straight into its frame's buffer (`get_buffer` is where the next `recv_into` writes), and only
the chunk framing (CRLF, the next chunk-size line) goes through a small buffer of its own. A
streamed weight push's bytes are so copied once, kernel to frame buffer; httptools would make a
`bytes` object of every piece of the body first, and the frames' assembly copy it again.

The last chunk's line and the trailer section after it are kept whole (`tail`) for the HTTP parser
of the connection, which checks them and ends the request as it would have on its own; bytes
after them are the next request's (`after`). Chunk extensions are allowed and ignored, as every
HTTP server does.
"""

from __future__ import annotations

import mmap

from rollout.http.frame_views import FrameAssembler, FrameTooLarge
from rollout.http.wire import WireError

_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
_MAX_SIZE_DIGITS = 16  # 64 bits of chunk size, as llhttp reads it
_MAX_LINE_BYTES = 4096  # a chunk-size line with its extensions
_FRAMING_READ_BYTES = 64  # a CRLF and a size line; what follows them is copied into the frame
_DISCARD_READ_BYTES = 256 << 10
_SIZE, _DATA, _DATA_END, _TAIL, _DONE = "size", "data", "data end", "tail", "done"


class MalformedChunks(WireError):
    """The body's chunked framing is broken: where the body ends is lost with it."""


class BodyTooLarge(WireError):
    """The chunks announce more data than the reader takes."""


class ChunkedFrameReader:
    """Decodes one chunked body into `assembler`'s frames. Either `get_buffer()` then
    `buffer_updated(n)` once `n` bytes are written into it, or `feed(data)` for bytes read
    elsewhere; both return the frames completed, and raise MalformedChunks. `done` once the
    trailers have ended; with `discarding` set, the chunks' data is dropped instead (a body whose
    request is answered). Data over a limit (a frame's, the body's) sets `refused` and discarding,
    and the framing is read on, so that the body's end is still found."""

    def __init__(self, assembler: FrameAssembler, max_data_bytes: int, max_tail_bytes: int):
        self.assembler = assembler
        self.max_data_bytes = max_data_bytes
        self.max_tail_bytes = max_tail_bytes
        self.data_bytes = 0  # of chunk data announced so far
        self.discarding = False
        self.refused: FrameTooLarge | BodyTooLarge | None = None
        self.tail: bytes | None = None  # the last chunk's line and the trailers, for the HTTP parser
        self.after = bytearray()  # bytes read past the body
        self._state = _SIZE
        self._left = 0  # bytes of the current chunk's data still to come
        self._line = bytearray()  # framing bytes of the current state that have arrived
        self._framing = memoryview(bytearray(_FRAMING_READ_BYTES))
        self._discard: memoryview | None = None

    @property
    def done(self) -> bool:
        return self._state is _DONE

    def get_buffer(self) -> memoryview:
        if self._state is not _DATA:
            return self._framing
        if self.discarding:
            if self._discard is None:
                self._discard = memoryview(bytearray(_DISCARD_READ_BYTES))
            return self._discard[: self._left]
        return self.assembler.get_buffer()[: self._left]

    def buffer_updated(self, nbytes: int) -> list[bytearray | mmap.mmap]:
        if self._state is _DATA:
            frame = self._data_arrived(nbytes)
            return [] if frame is None else [frame]
        return self.feed(self._framing[:nbytes])

    def feed(self, data) -> list[bytearray | mmap.mmap]:
        view, frames = memoryview(data), []
        while view:
            if self._state is _DATA:
                target = self.get_buffer()  # never the framing buffer, which `data` may be
                taken = min(len(view), len(target))
                target[:taken] = view[:taken]
                frame = self._data_arrived(taken)
                if frame is not None:
                    frames.append(frame)
            elif self._state is _DONE:
                self.after += view
                taken = len(view)
            else:
                taken = self._framing_arrived(view)
            view = view[taken:]
        return frames

    def _data_arrived(self, nbytes: int) -> bytearray | mmap.mmap | None:
        self._left -= nbytes
        if self._left == 0:
            self._state = _DATA_END
        if self.discarding:
            return None
        try:
            return self.assembler.buffer_updated(nbytes)
        except FrameTooLarge as error:
            self._refuse(error)
            return None

    def _refuse(self, error: FrameTooLarge | BodyTooLarge) -> None:
        self.refused = self.refused or error
        self.discarding = True
        self.assembler.release()

    def _framing_arrived(self, view: memoryview) -> int:
        """Takes framing bytes from the start of `view`; returns how many."""
        if self._state is _DATA_END:  # the CRLF that ends a chunk's data
            taken = view[: 2 - len(self._line)]
            self._line += taken
            if self._line != b"\r\n"[: len(self._line)]:
                raise MalformedChunks(f"a chunk's data is followed by {bytes(self._line)!r}, not CRLF")
            if len(self._line) == 2:
                self._state = _SIZE
                self._line.clear()
            return len(taken)
        if self._state is _SIZE:
            piece = bytes(view[: _MAX_LINE_BYTES + 1 - len(self._line)])
            end = piece.find(b"\n") + 1
            self._line += piece[:end] if end else piece
            if end:
                self._size_line_arrived()
            elif len(self._line) > _MAX_LINE_BYTES:
                raise MalformedChunks(f"a chunk-size line runs past {_MAX_LINE_BYTES} bytes")
            return end or len(piece)
        piece = bytes(view[: self.max_tail_bytes + 1 - len(self._line)])  # the trailers
        searched = max(0, len(self._line) - 3)
        self._line += piece
        end = self._line.find(b"\r\n\r\n", searched) + 4
        if end < 4:
            if len(self._line) > self.max_tail_bytes:
                raise MalformedChunks(f"the body's trailer section runs past {self.max_tail_bytes} bytes")
            return len(piece)
        self.tail, extra = bytes(self._line[:end]), len(self._line) - end
        self._state = _DONE
        return len(piece) - extra

    def _size_line_arrived(self) -> None:
        line = bytes(self._line)
        size, _, extensions = line[:-2].partition(b";")
        if not line.endswith(b"\r\n"):
            raise MalformedChunks(f"the chunk-size line {line[:80]!r} ends in LF without CR")
        if not size or len(size) > _MAX_SIZE_DIGITS or not _HEX_DIGITS.issuperset(size):
            raise MalformedChunks(f"the chunk-size line {line[:80]!r} does not start with a hexadecimal size")
        if any(byte < 0x20 and byte != 0x09 or byte == 0x7F for byte in extensions):
            raise MalformedChunks(f"the chunk-size line {line[:80]!r} holds control characters")
        self._left = int(size, 16)
        if self._left == 0:  # the last chunk: its line starts the tail
            self._state = _TAIL
            return
        self._line.clear()
        self.data_bytes += self._left
        if self.data_bytes > self.max_data_bytes:
            self._refuse(
                BodyTooLarge(f"the body's chunks announce {self.data_bytes} bytes, over {self.max_data_bytes}")
            )
        self._state = _DATA
