"""Views of the rows batch's caches as the model sees them in a step (worker/backends/rows.py):
each changes one thing a cache does and is the cache for everything else."""

from __future__ import annotations

from typing import Any


class CacheView:
    """A cache, but for what a subclass changes: what a model reads or writes on the view
    (offset, keys, ...) is the cache's own."""

    __slots__ = ("cache",)

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # a model may write the cache's arrays (mlx-lm's pipeline makes its last layer's
        # keys depend on the activations it sends on): they are the cache's
        if name == "cache":
            object.__setattr__(self, name, value)
        else:
            setattr(self.cache, name, value)


class Unpadded(CacheView):
    """A batch cache as the model sees it in a one-token step while none of the batch's rows
    is padded: no mask, so that MLX can take its fused attention kernel (a mask would only
    hide padding)."""

    __slots__ = ()

    def make_mask(self, N: int, *args: Any, **kwargs: Any) -> Any:
        return None if N == 1 else self.cache.make_mask(N, *args, **kwargs)
