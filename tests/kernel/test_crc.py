"""CRC-32C: both ways of computing it (the extension, the GIL-free C call) agree."""

from __future__ import annotations

import os

import google_crc32c
import pytest

from quiverd.kernel import crc as crcmod
from quiverd.kernel.crc import CHECK_VALUE, NO_GIL_MIN_BYTES, crc32c


def test_crc32c_check_value():
    assert crc32c(b"123456789") == CHECK_VALUE == 0xE3069283


def test_large_buffers_take_the_gil_free_c_call_of_the_bundled_library():
    assert crcmod._EXTEND is not None  # found beside google_crc32c and self-checked


@pytest.mark.parametrize("size", [0, 1, 4095, NO_GIL_MIN_BYTES - 1, NO_GIL_MIN_BYTES,
                                  (1 << 20) + 7])
def test_crc32c_equals_google_crc32c_for_every_buffer_type_and_size(size):
    data = os.urandom(size + 3)
    want = google_crc32c.extend(77, data[3:])
    for buf in (data[3:], bytearray(data[3:]), memoryview(data)[3:]):
        assert crc32c(buf, 77) == want
