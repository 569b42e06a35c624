"""Device placement: each module's mesh and pipeline-stage submeshes from ONE device list.

Three placements, all computed by :func:`module_positions` (the only place that decides
where modules' devices go; the run planner calls it too):

* ``"colocated"``: every module spans the same devices and reads them as its own logical
  grid (encoder ``dp=8`` and LLM ``dp=2,tp=4`` on the same eight devices).
* ``"non-colocated"``: every module owns a disjoint island of devices.
* ``"homogeneous"``: the stock Megatron baseline; the sink module spans all devices and
  the others sit on its first pipeline stage's.

All meshes are reshapes of slices of one global device list in a canonical order (the
order of ``jax.devices()`` unless given), never independent ``jax.make_mesh`` calls:
colocated meshes then share their flat device order and can meet inside one ``jit``.
Within a module the order is Megatron's default: ``tp`` on neighbouring devices, then
``cp``, ``ep``, ``fsdp``, ``dp``, and ``pp`` outermost, so pipeline stages map to hosts
(and the fsdp gathers, every layer's, stay closer than the once-per-step dp reduction).

Meshes use ``AxisType.Auto`` on purpose (the default of ``jax.sharding.Mesh``, unlike
``jax.make_mesh``): GSPMD propagates the TP/DP shardings that the logical-axis rules put
on parameters and inputs, and boundary ops may reshard freely inside a ``jit``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from .layout import MESH_AXES, STAGE_AXES, Layout, LayoutError

Placement = Literal["colocated", "non-colocated", "homogeneous"]


@dataclasses.dataclass(frozen=True)
class ModuleMesh:
    """One module's devices, full mesh and per-pipeline-stage submeshes."""

    name: str  # module name, used in error messages
    layout: Layout  # the module's parallel degrees
    devices: tuple[jax.Device, ...]  # the module's devices in canonical (mesh flat) order
    positions: tuple[int, ...]  # index of each device in the global device list

    @functools.cached_property
    def mesh(self) -> Mesh:
        """Full mesh with axes ``("pp", "dp", "fsdp", "ep", "cp", "tp")``."""
        array = np.empty(len(self.devices), dtype=object)
        array[:] = self.devices
        return Mesh(
            array.reshape(self.layout.mesh_shape),
            MESH_AXES,
            axis_types=(AxisType.Auto,) * len(MESH_AXES),
        )

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages (``layout.pp``)."""
        return self.layout.pp

    def stage_devices(self, stage: int) -> tuple[jax.Device, ...]:
        """Devices of pipeline stage ``stage`` (negative counts from the last stage)."""
        return tuple(self.stage_mesh(stage).devices.flat)

    def stage_mesh(self, stage: int) -> Mesh:
        """Submesh of pipeline stage ``stage`` with axes ``("dp", "fsdp", "ep", "cp", "tp")``.

        Args:
            stage: stage index in ``[-pp, pp)``; ``-1`` is the last stage.

        Raises:
            LayoutError: the stage does not exist.
        """
        if not -self.layout.pp <= stage < self.layout.pp:
            raise LayoutError(
                f"{self.name}: pipeline stage {stage} does not exist with pp={self.layout.pp};"
                f" use a stage in [0, {self.layout.pp})"
            )
        return _stage_mesh(self.mesh, stage % self.layout.pp)


@functools.cache
def _stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    # Cached so that repeated calls return one Mesh object (cheap jit cache hits).
    return Mesh(mesh.devices[stage], STAGE_AXES, axis_types=(AxisType.Auto,) * len(STAGE_AXES))


def validate_layout(module: str, layout: Layout, num_devices: int) -> None:
    """Checks that a module's degrees multiply to the devices it is given.

    Raises:
        LayoutError: ``dp * fsdp * tp * cp * pp != num_devices``.
    """
    if layout.num_devices != num_devices:
        names = [n for n in ("dp", "fsdp", "tp", "cp", "pp") if n != "fsdp" or layout.fsdp > 1]
        raise LayoutError(
            f"{module}: {'*'.join(names)} = {'*'.join(str(getattr(layout, n)) for n in names)}"
            f" = {layout.num_devices} but the module has {num_devices} devices; choose degrees"
            f" whose product is {num_devices}"
        )


def place_modules(
    layouts: Mapping[str, Layout | str],
    devices: Sequence[jax.Device] | None = None,
    *,
    placement: Placement,
    islands: Mapping[str, int | Sequence[int]] | None = None,
    sink: str | None = None,
) -> dict[str, ModuleMesh]:
    """Places modules on devices and builds their meshes from one global device list.

    Args:
        layouts: module name -> `Layout` (or a string for `Layout.parse`).
        devices: the global device list in canonical order; defaults to ``jax.devices()``.
        placement: ``"colocated"`` (every module spans all ``devices``),
            ``"non-colocated"`` (disjoint islands) or ``"homogeneous"`` (see
            :func:`module_positions`).
        islands: non-colocated only. Module name -> start position of its island in
            ``devices`` (the island is ``layout.num_devices`` consecutive devices), or an
            explicit sequence of positions. ``None`` packs the islands consecutively in
            the order of ``layouts``.
        sink: homogeneous only: the module that spans all devices.

    Returns:
        Module name -> `ModuleMesh`, in the order of ``layouts``.

    Raises:
        LayoutError: degrees that do not multiply to a module's device count, islands that
            overlap or exceed ``devices``, islands given for a colocated placement.

    Example:
        >>> meshes = place_modules({"vit": "dp=8", "llm": "dp=2,tp=4"}, placement="colocated")
    """
    devices = tuple(jax.devices() if devices is None else devices)
    parsed = {
        name: layout if isinstance(layout, Layout) else Layout.parse(layout, module=name)
        for name, layout in layouts.items()
    }
    positions = module_positions(
        parsed, len(devices), placement=placement, islands=islands, sink=sink
    )
    return module_meshes(parsed, devices, positions)


def module_positions(
    layouts: Mapping[str, Layout],
    num_devices: int,
    *,
    placement: Placement,
    islands: Mapping[str, int | Sequence[int]] | None = None,
    sink: str | None = None,
) -> dict[str, tuple[int, ...]]:
    """Where each module's devices go: positions in the run's device list, each module's
    layout checked against its device count. The one definition of every placement
    (:func:`place_modules` and :func:`hetjax.plan_run` both use it).

    Args:
        layouts: module name -> layout, in placement order.
        num_devices: devices of the run.
        placement: ``"colocated"``: every module on all devices. ``"non-colocated"``:
            disjoint islands (``islands`` as in :func:`place_modules`; counts become
            positions through :func:`island_positions`). ``"homogeneous"`` (the stock
            Megatron baseline): ``sink`` on all devices, every other module on the
            devices of the sink's first pipeline stage (``pp`` is the outermost axis).
        islands: non-colocated only: module -> island start position or positions.
        sink: homogeneous only: the module that spans all devices.

    Returns:
        Module name -> device positions, in the order of ``layouts``.

    Raises:
        LayoutError: degrees that do not multiply to a module's device count, islands that
            overlap or exceed the devices, islands given for a colocated placement.
    """
    everything = tuple(range(num_devices))
    if placement == "colocated":
        if islands is not None:
            raise LayoutError(
                "colocated modules share all devices; drop islands= or use"
                " placement='non-colocated'"
            )
        positions = dict.fromkeys(layouts, everything)
    elif placement == "non-colocated":
        positions = _island_positions(layouts, num_devices, islands)
    elif placement == "homogeneous":
        if sink not in layouts:
            raise LayoutError(
                f"homogeneous placement needs sink= naming one of {sorted(layouts)}, not {sink!r}"
            )
        validate_layout(sink, layouts[sink], num_devices)
        first = everything[: num_devices // layouts[sink].pp]
        positions = {n: everything if n == sink else first for n in layouts}
    else:
        raise LayoutError(
            f"placement={placement!r} is unknown; use 'colocated', 'non-colocated' or 'homogeneous'"
        )
    for name, layout in layouts.items():
        validate_layout(name, layout, len(positions[name]))
    return positions


def module_meshes(
    layouts: Mapping[str, Layout],
    devices: Sequence[jax.Device],
    positions: Mapping[str, Sequence[int]],
) -> dict[str, ModuleMesh]:
    """Each module's :class:`ModuleMesh` over its ``positions`` in ``devices`` (the run's
    device list in canonical order), in the order of ``layouts``."""
    return {
        name: ModuleMesh(
            name=name,
            layout=layout,
            devices=tuple(devices[p] for p in positions[name]),
            positions=tuple(positions[name]),
        )
        for name, layout in layouts.items()
    }


def _island_positions(
    layouts: Mapping[str, Layout],
    num_devices: int,
    islands: Mapping[str, int | Sequence[int]] | None,
) -> dict[str, tuple[int, ...]]:
    if islands is not None and set(islands) != set(layouts):
        raise LayoutError(
            f"islands name modules {sorted(islands)} but layouts name {sorted(layouts)};"
            " give one island per module"
        )
    positions: dict[str, tuple[int, ...]] = {}
    start = 0
    for name, layout in layouts.items():
        spec = start if islands is None else islands[name]
        if isinstance(spec, int):
            island = tuple(range(spec, spec + layout.num_devices))
        else:
            island = tuple(int(p) for p in spec)
        if len(set(island)) != len(island):
            raise LayoutError(f"{name}: island {island} repeats a device; list each once")
        if island and (min(island) < 0 or max(island) >= num_devices):
            raise LayoutError(
                f"{name}: island at positions {island[0]}..{island[-1]} exceeds the"
                f" {num_devices} devices; move it or give more devices"
            )
        for other, taken in positions.items():
            shared = sorted(set(island) & set(taken))
            if shared:
                raise LayoutError(
                    f"{name}: island overlaps {other}'s island at device positions {shared};"
                    " give disjoint islands or use placement='colocated'"
                )
        positions[name] = island
        start = (max(island) + 1) if island else start
    return positions


def island_positions(
    counts: Mapping[str, int] | None, layouts: Mapping[str, Layout], num_devices: int
) -> dict[str, tuple[int, ...]]:
    """Island device COUNTS, assigned in order, as device positions (non-colocated).

    The one place where island sizes become positions: errors name the ``islands``
    parameter (front ends translate that into their own flag names).

    Args:
        counts: module -> number of devices of its island, in placement order.
        layouts: module -> layout; an island must have exactly its layout's devices.
        num_devices: devices of the run.

    Returns:
        Module -> consecutive device positions.

    Raises:
        LayoutError: no islands, a module without (or an unknown module with) an island,
            an island whose size disagrees with its layout, islands that do not fit.
    """
    need = {n: l.num_devices for n, l in layouts.items()}
    if not counts:
        raise LayoutError(
            f"non-colocated placement needs an island per module, e.g. islands={need} for "
            f"these layouts (assigned in order; together at most num_devices={num_devices})"
        )
    missing = [n for n in layouts if n not in counts]
    unknown = [n for n in counts if n not in layouts]
    if missing or unknown:
        raise LayoutError(
            f"islands must name each module once: missing {missing}, unknown {unknown}"
        )
    positions, start = {}, 0
    for name, count in counts.items():
        if count != need[name]:
            raise LayoutError(
                f"{name}: island of {count} devices but its layout {layouts[name]} needs "
                f"{need[name]}; make islands={{{name!r}: {need[name]}}} match the layout"
            )
        positions[name] = tuple(range(start, start + count))
        start += count
    if start > num_devices:
        raise LayoutError(
            f"islands need {start} devices but only {num_devices} exist; shrink the islands "
            f"or use num_devices={start}"
        )
    return positions
