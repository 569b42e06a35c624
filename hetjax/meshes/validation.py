"""Shape checks for one module's layout: batch, heads, layers, widths against its degrees.

Checking here, before anything is compiled, turns an XLA divisibility traceback deep
inside a stage program into one line that names the module, the numbers and the fix.
(Device-count and island checks live in `placement.py`; ``ep | dp`` in `Layout` itself.)
"""

from __future__ import annotations

from typing import Any

import jax

from .layout import Layout, LayoutError
from .rules import is_logical_names


def validate_batch(module: str, layout: Layout, global_batch: int, microbatches: int = 1) -> None:
    """Checks that every data-parallel rank gets whole samples in every microbatch.

    Args:
        module: module name for the error message.
        layout: the module's layout.
        global_batch: samples per optimiser step.
        microbatches: microbatches per step.

    Raises:
        LayoutError: ``global_batch`` not divisible by ``dp * fsdp * microbatches`` (the
            batch splits over both).
    """
    if microbatches < 1:
        raise LayoutError(f"{module}: microbatches={microbatches} must be >= 1")
    per = layout.data_ranks * microbatches
    if global_batch % per:
        lower = global_batch // per * per
        examples = f"{lower} or {lower + per}" if lower else f"{per}"
        ranks, sizes = (
            ("dp*fsdp", f"{layout.dp}*{layout.fsdp}")
            if layout.fsdp > 1
            else (
                "dp",
                f"{layout.dp}",
            )
        )
        raise LayoutError(
            f"{module}: global batch {global_batch} is not divisible by {ranks}*microbatches ="
            f" {sizes}*{microbatches} = {per}; use a batch that is a multiple of {per}"
            f" (e.g. {examples}) or change {ranks.replace('*', '/')}/microbatches"
        )


# size name -> (degree that must divide it, why)
_DIVISORS = {
    "heads": ("tp", "attention heads are split over tensor-parallel ranks"),
    "kv_heads": ("tp", "key/value heads are split over tensor-parallel ranks"),
    "mlp": ("tp", "the MLP hidden width is split over tensor-parallel ranks"),
    "vocab": ("tp", "the vocabulary is split over tensor-parallel ranks"),
    "layers": ("pp", "layers are split evenly over pipeline stages"),
    "experts": ("ep", "experts are split over expert-parallel ranks"),
    "seq": ("cp", "the sequence is split over context-parallel ranks"),
}


def validate_divisible(
    module: str,
    layout: Layout,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    mlp: int | None = None,
    vocab: int | None = None,
    layers: int | None = None,
    experts: int | None = None,
    seq: int | None = None,
) -> None:
    """Checks model sizes against the degrees that split them.

    Args:
        module: module name for the error message.
        layout: the module's layout.
        heads, kv_heads, mlp, vocab: must be divisible by ``tp``.
        layers: must be divisible by ``pp``.
        experts: must be divisible by ``ep``.
        seq: tokens per sample; must be divisible by ``cp``.
        Sizes left as None are not checked.

    Raises:
        LayoutError: the first size that its degree does not divide.
    """
    sizes = dict(
        heads=heads,
        kv_heads=kv_heads,
        mlp=mlp,
        vocab=vocab,
        layers=layers,
        experts=experts,
        seq=seq,
    )
    for name, size in sizes.items():
        if size is None:
            continue
        degree_name, why = _DIVISORS[name]
        degree = getattr(layout, degree_name)
        if size % degree:
            divisors = [d for d in range(1, degree) if size % d == 0]
            raise LayoutError(
                f"{module}: {name}={size} is not divisible by {degree_name}={degree} ({why});"
                f" use {degree_name} in {divisors[-4:]} or a {name} that is a multiple"
                f" of {degree}"
            )


def validate_fsdp(module: str, layout: Layout, axes: Any, abstract: Any) -> None:
    """Checks that ``fsdp`` splits every parameter dimension it is meant to split.

    Args:
        module: module name for the error message.
        layout: the module's layout.
        axes: the parameters' logical axis names (a tree of tuples).
        abstract: the parameters (arrays or ``ShapeDtypeStruct`` s), same tree.

    Raises:
        LayoutError: a dimension named ``"embed"`` (the one fsdp splits) whose size
            ``fsdp`` does not divide, naming the parameter and the fix.
    """
    if layout.fsdp == 1:
        return
    flat_axes = jax.tree.leaves(axes, is_leaf=is_logical_names)
    flat = jax.tree.leaves_with_path(abstract)
    for names, (path, a) in zip(flat_axes, flat, strict=True):
        for name, size in zip(names, a.shape, strict=True):
            if name == "embed" and size % layout.fsdp:
                divisors = [d for d in range(2, layout.fsdp) if size % d == 0]
                raise LayoutError(
                    f"{module}: fsdp={layout.fsdp} does not divide the model width {size}"
                    f" of parameter {jax.tree_util.keystr(path)} {tuple(a.shape)} (its"
                    f" 'embed' dim is split over fsdp); use fsdp in {[1, *divisors]} or a"
                    f" width that is a multiple of {layout.fsdp}"
                )
