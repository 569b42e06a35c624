"""Pick a schedule by name, for CLIs and configs.

Each generator has its own signature; `schedule_for` maps one flat set of arguments
(a name, M, and either a stage count or a module graph) onto the right one, so a config
field ``schedule: "1f1b"`` needs no code in the entry point.
"""

from __future__ import annotations

from typing import Literal, get_args

from .fused import fused_encoders
from .gpipe import gpipe, graph_gpipe
from .graph import ModuleGraph
from .one_f_one_b import graph_one_f_one_b, one_f_one_b
from .schedule import Schedule
from .three_phase import three_phase_for_graph

ScheduleName = Literal["gpipe", "1f1b", "graph_1f1b", "three_phase", "fused_1f1b", "fused_gpipe"]
"""Names `schedule_for` accepts: ``gpipe`` and ``1f1b`` take ``num_stages`` or a graph;
``graph_1f1b`` (non-colocated), ``three_phase`` (colocated) and ``fused_1f1b`` /
``fused_gpipe`` (the homogeneous baseline: encoders inside the sink's first stage) take a
graph."""

SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)


def schedule_for(
    name: ScheduleName | str,
    num_microbatches: int,
    *,
    num_stages: int | None = None,
    graph: ModuleGraph | None = None,
) -> Schedule:
    """Build the schedule called ``name``.

    Args:
        name: One of `SCHEDULE_NAMES`.
        num_microbatches: Microbatches per step (M).
        num_stages: Stage count of a linear pipeline (``gpipe``, ``1f1b``).
        graph: Module graph (required by ``graph_1f1b`` and ``three_phase``; for
            ``gpipe`` and ``1f1b`` it replaces ``num_stages``, and ``1f1b`` on a graph
            is graph-aware 1F1B).

    Returns:
        The schedule.

    Raises:
        ValueError: On an unknown name, or when the arguments the schedule needs are
            missing or both ``num_stages`` and ``graph`` are given.

    Example:
        >>> schedule_for("1f1b", 8, num_stages=4).name
        '1f1b'
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; pick one of: {', '.join(SCHEDULE_NAMES)}.")
    if num_stages is not None and graph is not None:
        raise ValueError("pass num_stages or graph, not both.")
    if name in ("gpipe", "1f1b") and graph is None:
        if num_stages is None:
            raise ValueError(f"schedule {name!r} needs num_stages=P (or graph=...).")
        return (gpipe if name == "gpipe" else one_f_one_b)(num_stages, num_microbatches)
    if graph is None:
        raise ValueError(f"schedule {name!r} needs graph=ModuleGraph(...), not num_stages.")
    if name == "gpipe":
        return graph_gpipe(graph, num_microbatches)
    if name in ("fused_1f1b", "fused_gpipe"):
        return fused_encoders(graph, num_microbatches, order=name.removeprefix("fused_"))
    if name == "three_phase":
        return three_phase_for_graph(graph, num_microbatches)
    return graph_one_f_one_b(graph, num_microbatches)
