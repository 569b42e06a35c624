"""Parameters on disk that read only the slices asked for.

The executor places parameters with ``jax.make_array_from_callback``, so a
:class:`LazyTensor` leaf lets each process read only the layers (pipeline stage) and rows
or columns (tensor parallelism) that its own devices hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Index = tuple[slice, ...]


class LazyTensor:
    """An array-like view of a parameter on disk: ``x[index]`` reads only that slice.

    ``shape``/``dtype`` are the hetjax parameter's; ``read(index)`` gets a tuple of
    ``slice`` (step 1) per dimension. ``rows(start, stop)`` cuts a stacked leaf to a
    pipeline stage's layers without reading. ``np.asarray(x)`` reads all of it.
    """

    def __init__(self, shape: tuple[int, ...], read: Callable[[Index], np.ndarray]):
        self.shape = tuple(shape)
        self.dtype = np.dtype(np.float32)
        self.ndim = len(self.shape)
        self._read = read

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __getitem__(self, index: Any) -> np.ndarray:
        if index is Ellipsis:
            index = ()
        index = index if isinstance(index, tuple) else (index,)
        full = [slice(None)] * self.ndim
        full[: len(index)] = index
        norm = []
        for s, n in zip(full, self.shape, strict=True):
            if not isinstance(s, slice) or s.step not in (None, 1):
                raise IndexError(f"LazyTensor takes slices of step 1, not {s!r}")
            norm.append(slice(*s.indices(n)[:2]))
        out = np.asarray(self._read(tuple(norm)), np.float32)
        expected = tuple(s.stop - s.start for s in norm)
        assert out.shape == expected, (out.shape, expected)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    def rows(self, start: int, stop: int) -> LazyTensor:
        def read(index: Index) -> np.ndarray:
            first = slice(index[0].start + start, index[0].stop + start)
            return self._read((first, *index[1:]))

        return LazyTensor((stop - start, *self.shape[1:]), read)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape})"
