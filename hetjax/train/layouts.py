"""A run's layouts: parsed into :class:`~hetjax.Layout` once, defaults filled.

The one place where layout text becomes ``Layout`` objects (``parallel.layouts``), a
module without a layout inherits the sink's, and a run that names none gets the stock
defaults (:func:`default_layouts`). What comes out is a :class:`LayoutChoice`: objects,
never text, so a planner (``--layout auto``) hands its choices to the trainer in the
same form and nothing is printed and parsed again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hetjax.config import module_layouts
from hetjax.meshes import Layout, LayoutError
from hetjax.runtime.lowering import Mode


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """Where and how every module runs: layouts, mode, islands and microbatches.

    Attributes:
        layouts: module -> layout, every module of the model.
        mode: ``"colocated"``, ``"non-colocated"`` or ``"homogeneous"``.
        islands: non-colocated: module -> device count of its island (``None``: the
            layouts' device counts, in module order).
        microbatches: pipeline microbatches per global batch.
    """

    layouts: Mapping[str, Layout]
    mode: Mode = "colocated"
    islands: Mapping[str, int] | None = None
    microbatches: int = 1

    def __str__(self) -> str:
        shown = "; ".join(f"{name} {layout}" for name, layout in self.layouts.items())
        return f"{self.mode}: {shown}"


def default_layouts(
    modules: Sequence[str], num_devices: int, mode: Mode = "colocated"
) -> dict[str, Layout]:
    """The layouts of a run given none (the sink, e.g. the LLM, is ``modules[-1]``).

    Colocated (and the homogeneous baseline): every module over all devices, the sink as
    ``pp=2, tp=2`` when the count allows it, else data parallel. Non-colocated, whose
    islands must share the devices: the sink on half of them and the encoders splitting
    the other half evenly (8 devices, one encoder: ``vision dp=4``, ``llm dp=1,tp=2,pp=2``,
    islands ``vision:4 llm:4``).
    """
    sink, encoders = modules[-1], list(modules[:-1])

    def sink_layout(n: int) -> Layout:
        return Layout(dp=n // 4, tp=2, pp=2) if n % 4 == 0 else Layout(dp=n)

    if mode != "non-colocated" or not encoders or num_devices < len(modules):
        return {
            m: sink_layout(num_devices) if m == sink else Layout(dp=num_devices) for m in modules
        }
    half = num_devices // 2
    each = (num_devices - half) // len(encoders)
    return {m: sink_layout(half) if m == sink else Layout(dp=each) for m in modules}


def resolve_layouts(
    given: Mapping[str, str | Layout],
    modules: Sequence[str],
    *,
    num_devices: int,
    mode: Mode,
) -> dict[str, Layout]:
    """Every module's layout from what a config gives (text or objects).

    Args:
        given: module -> layout (``parallel.layouts``); empty: :func:`default_layouts`.
        modules: the model's module names, the sink last.
        num_devices: devices of the run (for the defaults).
        mode: the run's mode (for the defaults).

    Raises:
        InvalidConfigError: a module that is not one of ``modules``.
        LayoutError: text that does not parse, or layouts given without the sink's.
    """
    sink = modules[-1]
    if not given:
        return default_layouts(modules, num_devices, mode)
    texts = {name: str(value) for name, value in given.items()}
    parsed = module_layouts(texts, modules)  # names checked, text parsed (one-line errors)
    parsed.update({n: v for n, v in given.items() if isinstance(v, Layout)})
    if sink not in parsed:
        what = "LLM" if sink == "llm" else sink
        raise LayoutError(
            f"give the {what}'s layout too, e.g. layouts={{'{sink}': 'dp=2,tp=2,pp=2'}} "
            "(modules without a layout inherit it)"
        )
    return {name: parsed.get(name, parsed[sink]) for name in modules}
