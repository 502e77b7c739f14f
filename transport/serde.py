"""Objects <-> frames: pickle protocol 5 with out-of-band buffers.

Frame 0 is the pickle stream; frames 1.. are the raw bytes of CPU tensors,
numpy arrays, memoryviews and large top-level bytes / bytearray. The writer
copies each buffer once (into the ring or the socket); the reader rebuilds
tensors as views of the received memory, never copying them into the stream.

Plain ``bytes`` and ``bytearray`` nested inside other objects stay in the
stream: CPython's pickler serializes those exact types before any hook can
see them. Wrap large
nested binary payloads in ``memoryview`` or ``bytearray`` to send them
out-of-band.

Only the transport's peers (same-user shared memory, or sockets of the same
cluster) may feed `loads`: unpickling runs code chosen by the sender.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import sys
import warnings
from typing import Any

__all__ = ["Serializer", "loads", "OOB_MIN_BYTES", "RAW", "RAW_MAX_BYTES"]

#: Buffers smaller than this stay inside the pickle stream.
OOB_MIN_BYTES = 4096

# Tensors rebuilt from read-only buffers (socket frames) are fine to read;
# torch warns once per process that it cannot mark them read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_torch = None
_tensor_type: type | None = None
_dtypes: dict[str, Any] = {}


def _tensor_cls() -> type | None:
    """torch.Tensor if torch is imported, without importing it ourselves."""
    global _torch, _tensor_type
    if _tensor_type is None:
        t = sys.modules.get("torch")
        if t is not None and hasattr(t, "Tensor"):
            _torch, _tensor_type = t, t.Tensor
    return _tensor_type


# dtypes sent raw (all have whole-byte elements); others keep torch's own pickling.
_RAW_DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex32",
    "complex64",
    "complex128",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
_by_dtype: dict[Any, str] = {}


def _rebuild_tensor(buf, dtype: str, shape: tuple[int, ...]):
    torch = _torch
    if torch is None:
        import torch  # noqa: F811
    dt = _dtypes.get(dtype)
    if dt is None:
        dt = _dtypes[dtype] = getattr(torch, dtype)
    if isinstance(buf, bytes):  # small, in-band: own a writable copy
        buf = bytearray(buf)
    if len(buf) == 0:
        return torch.empty(shape, dtype=dt)
    t = torch.frombuffer(buf, dtype=dt)
    return t if len(shape) == 1 else t.reshape(shape)


def _reduce_tensor(t):
    torch = _torch
    if not _by_dtype:
        _by_dtype.update({getattr(torch, n): n for n in _RAW_DTYPES if hasattr(torch, n)})
    dtype = _by_dtype.get(t.dtype)
    # Only plain dense CPU tensors; anything else keeps torch's own pickling.
    if dtype is None or not t.is_cpu or t.layout != torch.strided or t.requires_grad or t.is_nested:
        return NotImplemented
    if t.is_complex():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.nbytes
    if nbytes < OOB_MIN_BYTES:
        payload: Any = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
    else:
        raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
        raw._keep = t  # the memory must outlive the buffer object
        payload = pickle.PickleBuffer(raw)
    return _rebuild_tensor, (payload, dtype, tuple(t.shape))


def _rebuild_view(buf):
    return memoryview(buf)


class _BigBytes:
    """Top-level bytes/bytearray sent out-of-band; rebuilt as their type (one copy, at the reader)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray) -> None:
        self.data = data

    def __reduce_ex__(self, protocol):
        return type(self.data), (pickle.PickleBuffer(self.data),)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        tcls = _tensor_type or _tensor_cls()
        if tcls is not None and type(obj) is tcls:
            return _reduce_tensor(obj)
        if type(obj) is memoryview:
            if not obj.contiguous:
                obj = memoryview(obj.tobytes())
            return _rebuild_view, (pickle.PickleBuffer(obj),)
        return NotImplemented


_ATOMS = frozenset({int, float, str, bool, type(None)})
#: The first byte of a small bytes message sent as it is, without pickle (a pickle stream starts with 0x80).
RAW = b"\x01"
#: Bytes messages up to this size go raw; bigger ones go out-of-band.
RAW_MAX_BYTES = 4096
_dumps = pickle.dumps
_loads = pickle.loads


class Serializer:
    """Reusable per-writer pickler (not thread-safe: one per queue, used by its writer)."""

    def __init__(self) -> None:
        self._bio = io.BytesIO()
        self._bufs: list[pickle.PickleBuffer] = []
        self._p = _Pickler(self._bio, 5, buffer_callback=self._on_buffer)

    def _on_buffer(self, pb: pickle.PickleBuffer) -> bool:
        # True keeps a small buffer in the stream; False sends it out-of-band.
        if pb.raw().nbytes < OOB_MIN_BYTES:
            return True
        self._bufs.append(pb)
        return False

    def dumps(self, obj: Any) -> list:
        """[pickle stream, *out-of-band buffers as 'B' memoryviews]."""
        if type(obj) is bytes and len(obj) <= RAW_MAX_BYTES:
            return [RAW + obj]
        if type(obj) in _ATOMS:  # nothing inside to send out-of-band: skip the stream set-up (a reply's int)
            return [_dumps(obj, 5)]
        if (type(obj) is bytes or type(obj) is bytearray) and len(obj) >= OOB_MIN_BYTES:
            obj = _BigBytes(obj)
        p, bio = self._p, self._bio
        try:
            p.dump(obj)
        except BaseException:
            self._bufs.clear()
            bio.seek(0)
            bio.truncate()
            raise
        finally:
            p.clear_memo()
        frames: list = [bio.getvalue()]
        bio.seek(0)
        bio.truncate()
        if self._bufs:
            frames.extend(pb.raw() for pb in self._bufs)
            self._bufs.clear()
        return frames


def loads(frame0: Any, buffers: Any = ()) -> Any:
    """The object of `dumps`'s frames (frame 0 any buffer)."""
    if frame0[0] == 1:  # RAW
        return bytes(frame0[1:])
    return _loads(frame0, buffers=buffers)
