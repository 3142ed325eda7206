"""Read and check a safetensors file's header (sizes, dtypes) without loading any tensor. Pure Python."""

from __future__ import annotations

import dataclasses
import json
import os
import struct

MAX_HEADER = 100 * 2**20
"""Largest header length accepted; a larger length field means the file is not safetensors."""

ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
"""Bytes per element of the safetensors dtypes whose tensor sizes are checked."""


class SafetensorsError(ValueError):
    """A file that is not a valid safetensors file; the message completes ``'<file>' ...``."""


@dataclasses.dataclass(frozen=True)
class SafetensorsInfo:
    """What a safetensors header says (read without loading any tensor)."""

    path: str
    file_bytes: int
    tensors: int
    data_bytes: int
    """Bytes of all tensors as stored in the file."""
    float_params: int
    """Number of floating-point values (their fp32 size is ``4 *`` this)."""
    float_bytes: int
    """Bytes of the floating-point tensors as stored."""
    dtypes: dict[str, int]
    """Stored dtype -> number of tensors."""


def read_safetensors_info(path: str) -> SafetensorsInfo:
    """Validate ``path``'s header and sizes; raises :class:`SafetensorsError` saying what is wrong."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"is truncated: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise SafetensorsError(f"is not a safetensors file (header length field {n} is implausible)")
            if 8 + n > size:
                raise SafetensorsError(f"is truncated: the header needs {8 + n} bytes, the file has {size}")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"cannot be read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsError(f"is not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError("is not a safetensors file (header is not a JSON object)")
    end = 0
    tensors = float_params = float_bytes = 0
    dtypes: dict[str, int] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = str(entry["dtype"])
            shape = [int(x) for x in entry["shape"]]
            begin, stop = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"is not a valid safetensors file (bad header entry {key!r})") from None
        numel = 1
        for d in shape:
            numel *= d
        item = ITEMSIZE.get(dtype)
        if stop < begin or (item is not None and stop - begin != numel * item):
            raise SafetensorsError(
                f"is corrupt: tensor {key!r} ({dtype} {shape}) has data offsets {begin}..{stop}"
            )
        end = max(end, stop)
        tensors += 1
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
        if dtype.startswith("F") or dtype == "BF16":
            float_params += numel
            float_bytes += stop - begin
    expected = 8 + n + end
    if size < expected:
        raise SafetensorsError(f"is truncated: its header describes {expected} bytes, the file has {size}")
    return SafetensorsInfo(
        path=path, file_bytes=size, tensors=tensors, data_bytes=end, float_params=float_params,
        float_bytes=float_bytes, dtypes=dtypes,
    )  # fmt: skip
