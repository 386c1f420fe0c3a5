"""Frame tables: per stored object, each frame's stored size and plaintext CRC64NVME.

The part pipeline (``shardvault.data.pipeline``) writes and reads them; the control plane reads
them too (a WAL batch's frames must add up to its stored size) without the pipeline's codecs:
this module needs neither zstd nor a cipher.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

FRAME_ENTRY = struct.Struct(">IQ")  # stored size, plaintext CRC64NVME


@dataclass(frozen=True)
class FrameInfo:
    stored_size: int
    crc64nvme: int  # of the plaintext


def pack_frames(frames: list[FrameInfo]) -> str:
    """The frame table's wire form: 12 bytes per frame, base64."""
    raw = b"".join(FRAME_ENTRY.pack(f.stored_size, f.crc64nvme) for f in frames)
    return base64.b64encode(raw).decode("ascii")


def unpack_frames(packed: str) -> list[FrameInfo]:
    """The frames of a packed table; ``ValueError`` if it is not one."""
    raw = base64.b64decode(packed, validate=True)
    if len(raw) % FRAME_ENTRY.size:
        raise ValueError(f"a frame table of {len(raw)} bytes is not whole entries")
    return [
        FrameInfo(*FRAME_ENTRY.unpack_from(raw, i)) for i in range(0, len(raw), FRAME_ENTRY.size)
    ]
