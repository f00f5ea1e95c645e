"""Where the verify path's tensors live, as one small interface.

On CUDA the verifier overlaps copies with compute: q rows go host -> device on a side
stream while the forward pass runs on the compute stream, and the verify launch waits on an
event recorded after the copies (the device waits, not the host). On the CPU every such step
is a no-op: a stream is the caller's thread, an event is complete once recorded, and host
buffers are plain memory. The same code therefore runs, and is tested, on both.

    device = Device("cuda")           # or "cpu", or a torch.device
    with device.side():               # launches in here go to the side stream (CPU: inline)
        out.copy_(pinned, non_blocking=True)
        ready = device.event()        # recorded on the side stream
    device.wait(ready)                # the current stream waits for it (CPU: nothing to do)
    buf = device.host_empty(n)        # pinned on CUDA (async copies), plain memory on CPU
    with device.use(): ...            # the calling thread's current device (Triton reads it)

Events also time things: `later.since(earlier)` is milliseconds between two events of
one device (CUDA: device timestamps, valid once both completed; CPU: host clock).
"""

from __future__ import annotations

import contextlib
import time

import torch

_CPU = torch.device("cpu")


class Event:
    """A point in a stream's work. CPU: complete when recorded, timed by the host clock."""

    __slots__ = ("_at", "_cuda", "_device")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        self._at = 0.0

    @classmethod
    def host_now(cls) -> Event:
        """A CPU event recorded now: `Event(cpu).record()` without its device checks (the
        engine takes four per batch)."""
        event = cls.__new__(cls)
        event._device, event._cuda, event._at = _CPU, None, time.perf_counter()
        return event

    def record(self) -> Event:
        """Mark the current stream's work so far (CPU: now)."""
        if self._cuda is not None:
            self._cuda.record(torch.cuda.current_stream(self._device))
        else:
            self._at = time.perf_counter()
        return self

    def wait(self) -> None:
        """Make the current stream (of this event's device) wait for this event; the host
        does not block."""
        if self._cuda is not None:
            self._cuda.wait(torch.cuda.current_stream(self._device))

    def synchronize(self) -> None:
        """Block the host until the event completed (CPU: it already has)."""
        if self._cuda is not None:
            self._cuda.synchronize()

    def done(self) -> bool:
        return self._cuda.query() if self._cuda is not None else True

    def since(self, earlier: Event) -> float:
        """Milliseconds from `earlier` to this event (both complete; CUDA: same device)."""
        if self._cuda is not None:
            return float(earlier._cuda.elapsed_time(self._cuda))
        return (self._at - earlier._at) * 1e3


class Device:
    """Streams, events and host buffers for one torch device; no-ops where there are none."""

    def __init__(self, device: torch.device | str | Device = "cpu") -> None:
        if isinstance(device, Device):
            device = device.torch
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.torch = device
        self.is_cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self.is_cuda else None

    def __repr__(self) -> str:
        return f"Device({str(self.torch)!r})"

    @property
    def type(self) -> str:
        return self.torch.type

    def use(self):
        """A context in which this device is the current one (kernel launchers such as
        Triton's read it from the calling thread; worker threads start on device 0)."""
        return torch.cuda.device(self.torch) if self.is_cuda else contextlib.nullcontext()

    @contextlib.contextmanager
    def side(self):
        """Launches inside go to this device's side stream (CPU: run inline)."""
        if self._side is None:
            yield
            return
        with torch.cuda.stream(self._side):
            yield

    def event(self) -> Event:
        """An event recorded now on the current stream (the side stream inside `side()`)."""
        return Event(self.torch).record() if self.is_cuda else Event.host_now()

    def wait(self, event: Event | None) -> None:
        """The current stream waits for `event` before its next launch (None: nothing)."""
        if event is not None:
            event.wait()

    def side_waits_for_current(self) -> None:
        """The side stream's next launches wait for everything queued on the current
        stream so far (memory the caller allocated or used there)."""
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.torch))

    def keep_for_side(self, tensor: torch.Tensor) -> None:
        """`tensor` is used on the side stream: its memory must outlive that use even if the
        caller drops it (CUDA's caching allocator otherwise reuses it at once)."""
        if self._side is not None and tensor.is_cuda:
            tensor.record_stream(self._side)

    def host_empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Host memory the device can copy from asynchronously (pinned on CUDA)."""
        return torch.empty(*shape, dtype=dtype, pin_memory=self.is_cuda)

    def empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=self.torch)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch)
