"""CUDA IPC handles of GPU-tier objects as plain data (CBOR), never as pickles.

torch's `reduce_tensor` describes a CUDA tensor by a rebuild function and its arguments;
pickling that pair and unpickling it from a shared index would run whatever code a writer
of the index chose. Instead the index holds only the fields, as a CBOR map of integers,
byte strings and booleans, and a reader rebuilds the tensor with torch's
`rebuild_cuda_tensor`, the one function it ever calls, after checking every field's type.
"""

from __future__ import annotations

from dataclasses import dataclass

import cbor2

_STORAGE_KINDS = ("typed", "untyped")  # torch.storage.TypedStorage / torch.UntypedStorage
_MAX_DIMS = 64


@dataclass(frozen=True)
class CudaIpcHandle:
    """The fields `reduce_tensor` gives for a plain (non-Parameter) CUDA tensor."""

    size: tuple[int, ...]  # tensor shape
    stride: tuple[int, ...]  # in elements, one per dimension
    offset: int  # tensor offset in its storage, in elements
    storage_kind: str  # "typed" | "untyped"
    dtype: str  # torch dtype name, e.g. "float32"
    device: int  # CUDA device index
    handle: bytes  # cudaIpcMemHandle of the allocation
    storage_size_bytes: int
    storage_offset_bytes: int  # the storage's offset in the allocation
    requires_grad: bool
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    @classmethod
    def from_reduction(cls, reduction) -> CudaIpcHandle:
        """From `torch.multiprocessing.reductions.reduce_tensor(cuda_tensor)`."""
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        rebuild, args = reduction
        (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size,
         storage_offset, requires_grad, rc_handle, rc_offset, event_handle, event_sync) = args
        if rebuild is not rebuild_cuda_tensor or tensor_cls is not torch.Tensor:
            raise ValueError("only plain CUDA tensors go into the GPU tier")
        if storage_cls is torch.storage.TypedStorage:
            kind = "typed"
        elif storage_cls is torch.UntypedStorage:
            kind = "untyped"
        else:
            raise ValueError(f"unexpected storage class {storage_cls!r}")
        return cls(tuple(size), tuple(stride), offset, kind, str(dtype).removeprefix("torch."),
                   device, handle, storage_size, storage_offset, bool(requires_grad), rc_handle,
                   rc_offset, event_handle, bool(event_sync))

    def encode(self) -> bytes:
        return cbor2.dumps({
            "size": list(self.size), "stride": list(self.stride), "offset": self.offset,
            "storage": self.storage_kind, "dtype": self.dtype, "device": self.device,
            "handle": self.handle, "storage_size": self.storage_size_bytes,
            "storage_offset": self.storage_offset_bytes, "requires_grad": self.requires_grad,
            "ref_counter_handle": self.ref_counter_handle,
            "ref_counter_offset": self.ref_counter_offset, "event_handle": self.event_handle,
            "event_sync_required": self.event_sync_required,
        })

    @classmethod
    def decode(cls, blob: bytes) -> CudaIpcHandle:
        """Parse and check an encoded handle; `ValueError` for anything else."""
        try:
            fields = cbor2.loads(blob)
        except Exception as exc:  # cbor2 raises several types; none of them runs code
            raise ValueError(f"not a CBOR handle: {exc}") from exc
        if not isinstance(fields, dict):
            raise ValueError("handle is not a CBOR map")
        size, stride = _ints(fields, "size"), _ints(fields, "stride")
        if len(size) != len(stride) or len(size) > _MAX_DIMS:
            raise ValueError("size and stride disagree")
        storage, dtype = fields.get("storage"), fields.get("dtype")
        if storage not in _STORAGE_KINDS or not isinstance(dtype, str) or not dtype.isidentifier():
            raise ValueError("bad storage kind or dtype")
        event_handle = fields.get("event_handle")
        if event_handle is not None and not isinstance(event_handle, bytes):
            raise ValueError("bad event_handle")
        return cls(size, stride, _int(fields, "offset"), storage, dtype, _int(fields, "device"),
                   _bytes(fields, "handle"), _int(fields, "storage_size"),
                   _int(fields, "storage_offset"), _bool(fields, "requires_grad"),
                   _bytes(fields, "ref_counter_handle"), _int(fields, "ref_counter_offset"),
                   event_handle, _bool(fields, "event_sync_required"))

    def rebuild(self):
        """Map the exporter's memory: a CUDA tensor sharing it (needs CUDA)."""
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        storage_cls = (torch.storage.TypedStorage if self.storage_kind == "typed"
                       else torch.UntypedStorage)
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(self.size), self.stride, self.offset, storage_cls, dtype,
            self.device, self.handle, self.storage_size_bytes, self.storage_offset_bytes,
            self.requires_grad, self.ref_counter_handle, self.ref_counter_offset,
            self.event_handle, self.event_sync_required)


def _int(fields: dict, name: str) -> int:
    value = fields.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"bad {name}")
    return value


def _ints(fields: dict, name: str) -> tuple[int, ...]:
    values = fields.get(name)
    if not isinstance(values, list):
        raise ValueError(f"bad {name}")
    return tuple(_int({name: v}, name) for v in values)


def _bytes(fields: dict, name: str) -> bytes:
    value = fields.get(name)
    if not isinstance(value, bytes):
        raise ValueError(f"bad {name}")
    return value


def _bool(fields: dict, name: str) -> bool:
    value = fields.get(name)
    if not isinstance(value, bool):
        raise ValueError(f"bad {name}")
    return value
