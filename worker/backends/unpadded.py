"""The rows batch's view of its caches without an attention mask (worker/backends/rows.py)."""

from __future__ import annotations

from typing import Any


class Unpadded:
    """A batch cache as the model sees it in a one-token step while none of the batch's rows
    is padded: no mask, so that MLX can take its fused attention kernel (a mask would only
    hide padding). Everything else is the cache's own."""

    __slots__ = ("cache",)

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def make_mask(self, N: int, *args: Any, **kwargs: Any) -> Any:
        return None if N == 1 else self.cache.make_mask(N, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # a model may write the cache's arrays (mlx-lm's pipeline makes its last layer's
        # keys depend on the activations it sends on): they are the cache's
        if name == "cache":
            object.__setattr__(self, name, value)
        else:
            setattr(self.cache, name, value)
