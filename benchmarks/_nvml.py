"""The GPU's busy share while a block runs, from NVML (NVIDIA GPUs with `pynvml`; else
None): the mean of NVML's utilization (the share of its last sample period in which a
kernel ran) polled every 50 ms."""

from __future__ import annotations

import statistics
import threading
from types import TracebackType
from typing import Any

POLL_S = 0.05


def _handle() -> Any:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no NVML here: no GPU figures, not an error
        return None


class BusyMeter:
    def __init__(self) -> None:
        self.handle = _handle()
        self.samples: list[int] = []
        self.share: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        import pynvml

        while not self._done.wait(POLL_S):
            self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def __enter__(self) -> BusyMeter:
        if self.handle is not None:
            self._thread = threading.Thread(target=self._poll, name="nvml", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            if self.samples:
                self.share = round(statistics.mean(self.samples), 1)
