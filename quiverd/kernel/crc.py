"""CRC-32C (Castagnoli), the only checksum quiverd writes.

``crc32c(b"123456789") == 0xE3069283``. The zlib/IEEE CRC-32 (0xCBF43926) is a
different polynomial: using it anywhere is a bug.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable

import google_crc32c
import pyarrow as pa

Buffer = bytes | bytearray | memoryview

CHECK_VALUE = 0xE3069283
# google_crc32c's extension holds the GIL while it checksums (measured: two threads take
# twice as long as one), so a 1 MiB payload's CRC stalls the event loop and every other
# worker. The same library's C function called through ctypes releases the GIL; its
# call costs ~0.5 µs more, so only large buffers take that way.
NO_GIL_MIN_BYTES = 16 * 1024  # a 64 KiB bundle's batch message is just under 64 KiB


def _c_extend() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, length)`` of the library google_crc32c bundles."""
    here = os.path.dirname(google_crc32c.__file__)
    for path in sorted(glob.glob(os.path.join(here, "..", "google_crc32c.libs", "libcrc32c*"))):
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        if fn(0, ctypes.c_char_p(b"123456789"), 9) == CHECK_VALUE:
            return fn
    return None


_EXTEND = _c_extend()


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``crc`` (0 starts a new checksum)."""
    # google_crc32c takes only bytes; a pyarrow buffer wraps the others without a copy.
    if not isinstance(data, bytes) or (_EXTEND is not None
                                        and len(data) >= NO_GIL_MIN_BYTES):
        buf = pa.py_buffer(data)
        if _EXTEND is not None and buf.size >= NO_GIL_MIN_BYTES:
            return int(_EXTEND(crc, buf.address, buf.size))
        return int(google_crc32c.extend(crc, buf))
    return int(google_crc32c.extend(crc, data))
