"""Host buffers for copies that do not wait for the device: pinned memory reused in rotation.

A copy from pinned host memory to a GPU (or back) with ``non_blocking=True`` returns before the device has run it,
so the host must not rewrite the buffer until it has. Where the host writes one buffer every round and rounds
overlap (``engine/scheduler.py``: the next round is launched before the last one is read), a single buffer would be
rewritten while the copy that reads it still waits in the stream. :class:`PinnedRing` hands out buffers in rotation
and waits, before handing one out again, for the event recorded after the copy that last used it (which has
normally long run). Off CUDA there is nothing to wait for: the copies are synchronous. (A copy from pageable host
memory would not do: torch waits for the device to finish all it was given before such a copy returns.)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class PinnedRing:
    """``size`` host tensors of one shape and dtype (pinned where ``device`` is a GPU), handed out in turn.

    :meth:`take` returns the next one once the copy that last used it has run; :meth:`used` records, on the current
    stream of ``device``, that a copy reading or writing it was enqueued. ``fill``: the buffers' first values.
    Raises ValueError for ``size`` < 1."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, size: int = 2, fill=0):
        if size < 1:
            raise ValueError(f"size must be >= 1 (buffers in rotation), got {size!r}")
        self.device = torch.device(device)
        self.shape, self.dtype, self.fill = tuple(shape), dtype, fill
        self.buffers: list = [None] * size  # allocated at first use (off CUDA, upload() needs none)
        self.events: list = [None] * size
        self.at = -1

    def take(self) -> torch.Tensor:
        """The next buffer in rotation, free to write (the copy that last used it has run)."""
        self.at = (self.at + 1) % len(self.buffers)
        event = self.events[self.at]
        if event is not None:
            event.synchronize()
            self.events[self.at] = None
        if self.buffers[self.at] is None:
            self.buffers[self.at] = torch.full(self.shape, self.fill, dtype=self.dtype,
                                               pin_memory=self.device.type == "cuda")
        return self.buffers[self.at]

    def used(self) -> Optional[torch.cuda.Event]:
        """The buffer :meth:`take` last returned has a copy enqueued on the device's current stream: returns the
        event recorded after it (None off CUDA), which a copy to the host waits on before its values are read."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.events[self.at] = event
        return event

    def upload(self, dst: torch.Tensor, write: Callable[[torch.Tensor], object]) -> None:
        """``write(buffer)`` into the next host buffer, then its copy into ``dst`` (on ``device``) enqueued without a
        wait; off CUDA ``write(dst)`` itself."""
        if self.device.type != "cuda":
            write(dst)
            return
        buf = self.take()
        write(buf)
        dst.copy_(buf, non_blocking=True)
        self.used()
