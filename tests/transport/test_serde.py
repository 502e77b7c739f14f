"""Serialization: big buffers go out-of-band, never into the pickle stream."""

from __future__ import annotations

import pickle

import pytest
import torch

from rayfree.transport.serde import OOB_MIN_BYTES, Serializer, loads


def roundtrip(obj):
    frames = Serializer().dumps(obj)
    return frames, loads(frames[0], [memoryview(bytearray(f)) for f in frames[1:]])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
        torch.uint16,
    ],
)
def test_tensor_bytes_travel_out_of_band(dtype) -> None:
    t = (torch.randn(256, 64) * 10).to(dtype) if dtype != torch.bool else torch.randn(256, 64) > 0
    frames, back = roundtrip({"x": t})
    nbytes = t.numel() * t.element_size()
    assert len(frames) == 2 and frames[1].nbytes == nbytes
    assert len(frames[0]) < 512, "tensor bytes were copied into the pickle stream"
    assert back["x"].dtype == dtype and back["x"].shape == t.shape
    assert torch.equal(back["x"].view(torch.uint8), t.view(torch.uint8))


def test_small_tensors_stay_in_band_and_odd_ones_round_trip() -> None:
    small = torch.arange(10)
    frames, back = roundtrip([small, torch.tensor(3.5), torch.empty(0, 4), torch.arange(100.0).reshape(10, 10).t()])
    assert len(frames) == 1
    assert torch.equal(back[0], small) and back[1].item() == 3.5 and back[2].shape == (0, 4)
    assert torch.equal(back[3], torch.arange(100.0).reshape(10, 10).t())


def test_tensor_requiring_grad_takes_torch_default_path() -> None:
    t = torch.ones(2000, requires_grad=True)
    frames, back = roundtrip(t)
    assert back.requires_grad and torch.equal(back.detach(), t.detach())


def test_big_top_level_bytes_and_bytearray_are_out_of_band() -> None:
    for obj in (b"a" * (OOB_MIN_BYTES * 4), bytearray(b"b" * (OOB_MIN_BYTES * 4))):
        frames, back = roundtrip(obj)
        assert len(frames) == 2 and len(frames[0]) < 200
        assert back == obj and type(back) is type(obj)


def test_nested_plain_bytes_stay_in_the_stream_as_documented() -> None:
    frames, back = roundtrip({"b": b"c" * (OOB_MIN_BYTES * 4)})
    assert len(frames) == 1 and back["b"] == b"c" * (OOB_MIN_BYTES * 4)


def test_a_failed_dump_leaves_the_serializer_usable() -> None:
    s = Serializer()
    with pytest.raises((pickle.PicklingError, TypeError, AttributeError)):
        s.dumps([torch.ones(OOB_MIN_BYTES), lambda: 1])
    frames = s.dumps("fine")
    assert len(frames) == 1 and loads(frames[0]) == "fine"
