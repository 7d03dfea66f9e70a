"""TensorBoard's record checksum, computed in C.

Each record of a TensorBoard event file ends with a masked CRC-32C of its bytes. Without
TensorFlow, the `tensorboard` package computes it in pure Python, a byte at a time: about
700,000 instructions (some 160 us) for a log point's event of 600 bytes, in the writer's
thread, holding the interpreter lock that the training loop needs. `google-crc32c` (a
dependency of saferun) computes the same checksum in C. `use_c_checksum` puts it in the
writer's place once it has given the writer's own values on a few samples; the event files
are the same bytes.
"""

from __future__ import annotations

from typing import Callable

_SAMPLES = (b"", b"\x00", b"saferun", bytes(range(256)) * 3)


def use_c_checksum() -> bool:
    """Make TensorBoard's event writer use the C checksum (process-wide); True if it does.
    Left as it is when `google-crc32c` is missing or without its C extension, or when the
    writer's checksum is not the package's own (TensorFlow's, or another's)."""
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    current = record_writer.masked_crc32c
    if current is masked_crc32c:
        return True
    if google_crc32c.implementation != "c" or current is not _python_crc():
        return False  # (its pure-Python fallback is no faster)
    if any(masked_crc32c(sample) != current(sample) for sample in _SAMPLES):
        return False
    record_writer.masked_crc32c = masked_crc32c
    return True


def _python_crc() -> Callable[[bytes], int]:
    """The `tensorboard` package's own checksum (pure Python)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as own

    return own


def masked_crc32c(data: bytes) -> int:
    """The CRC-32C of `data`, masked as TensorFlow's record format masks it."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
