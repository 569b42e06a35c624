"""A minimal PNG writer (zlib + struct), so drawing a Gantt chart needs no plotting stack.

The schedules package stays pure Python plus numpy; pulling in matplotlib or Pillow for
one picture would make every environment that checks schedules heavier. PNG is simple
enough to write by hand: the 8-byte signature, then chunks (length, type, data, CRC-32)
- ``IHDR`` (size, 8-bit RGB), one ``IDAT`` holding the zlib-compressed scanlines, each
prefixed by filter byte 0 (no filter), and an empty ``IEND``.
"""

from __future__ import annotations

import pathlib
import struct
import zlib

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def encode_png(pixels_HxWx3: np.ndarray) -> bytes:
    """Encode an RGB image as PNG bytes.

    Args:
        pixels_HxWx3: uint8 array, H rows of W pixels of (red, green, blue).

    Returns:
        The PNG file contents.

    Raises:
        ValueError: If the array is not a non-empty uint8 HxWx3 array.

    Example:
        >>> data = encode_png(np.zeros((2, 3, 3), np.uint8))
        >>> data[:8] == PNG_SIGNATURE, struct.unpack(">II", data[16:24])
        (True, (3, 2))
    """
    pixels = np.asarray(pixels_HxWx3)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
        raise ValueError(
            f"expected a non-empty uint8 array of shape (H, W, 3), got {pixels.dtype} "
            f"{pixels.shape}."
        )
    height, width, _ = pixels.shape
    # Filter type 0 ("None") in front of every scanline.
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, -1)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"".join(
        [
            PNG_SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)),
            _chunk(b"IEND", b""),
        ]
    )


def write_png(path: str | pathlib.Path, pixels_HxWx3: np.ndarray) -> pathlib.Path:
    """Encode ``pixels_HxWx3`` (see `encode_png`) and write it to ``path``.

    Returns:
        ``path`` as a `pathlib.Path`; parent folders are created if missing.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_png(pixels_HxWx3))
    return path


def read_png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from PNG bytes, checking the signature and IHDR.

    Raises:
        ValueError: If ``data`` does not start like a PNG file.
    """
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file (bad signature or missing IHDR).")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)
