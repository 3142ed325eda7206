"""memory/safetensors_header.py: sizes and dtypes from a header, and the errors of bad files."""

from __future__ import annotations

import json
import struct

import pytest
from vramfit.memory.safetensors_header import SafetensorsError, read_safetensors_info


def _write(path, header: dict, data: bytes) -> str:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def test_sizes_and_dtypes(tmp_path) -> None:
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]},
        "c": {"dtype": "I64", "shape": [1], "data_offsets": [28, 36]},
    }
    info = read_safetensors_info(_write(tmp_path / "ok.safetensors", header, bytes(36)))
    assert (info.tensors, info.data_bytes, info.float_params, info.float_bytes) == (3, 36, 10, 28)
    assert info.dtypes == {"BF16": 1, "F32": 1, "I64": 1}


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"abc", "is truncated: 3 bytes"),
        (struct.pack("<Q", 2**40) + b"{}", "header length field"),
        (struct.pack("<Q", 2) + b"[]", "header is not a JSON object"),
        (struct.pack("<Q", 2) + b"{x", "header is not JSON"),
    ],
)
def test_bad_files(tmp_path, content: bytes, why: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(SafetensorsError, match=why):
        read_safetensors_info(str(path))


def test_corrupt_and_truncated_data(tmp_path) -> None:
    bad = {"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 4]}}
    with pytest.raises(SafetensorsError, match="is corrupt: tensor 'a'"):
        read_safetensors_info(_write(tmp_path / "c.safetensors", bad, bytes(4)))
    short = {"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}
    with pytest.raises(SafetensorsError, match="its header describes"):
        read_safetensors_info(_write(tmp_path / "t.safetensors", short, bytes(4)))
