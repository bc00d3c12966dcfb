"""CRC-32C (Castagnoli), the only checksum quiverd writes.

``crc32c(b"123456789") == 0xE3069283``. The zlib/IEEE CRC-32 (0xCBF43926) is a
different polynomial: using it anywhere is a bug.
"""

from __future__ import annotations

import google_crc32c
import pyarrow as pa

Buffer = bytes | bytearray | memoryview

CHECK_VALUE = 0xE3069283


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``crc`` (0 starts a new checksum)."""
    # google_crc32c refuses memoryview; a pyarrow buffer wraps it without a copy.
    if isinstance(data, memoryview):
        data = pa.py_buffer(data)
    return int(google_crc32c.extend(crc, data))
