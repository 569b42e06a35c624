"""Per-module parallel layouts: the degrees (dp, fsdp, tp, cp, pp, ep) one module trains with.

A `Layout` is only numbers; it owns no devices (`placement.py` turns layouts into meshes).
Unlike a single parallel config for the whole model, every module of the multimodal graph
gets its own `Layout`, so an encoder can run with ``dp=8`` next to an LLM with
``dp=2,tp=4`` on the same eight devices.

Degrees follow Megatron: ``dp * fsdp * tp * cp * pp`` devices per module; ``ep`` does not
add devices, it groups experts inside the data-parallel ranks and must divide ``dp``.

``fsdp`` is MaxText's ``fsdp`` axis: more data-parallel ranks (the batch splits over
``dp * fsdp``) that also shard the parameters, their gradients and the optimizer state
(each layer's weights are gathered inside the layer scan). ``dp`` counts the replicas
that each hold a whole copy of that sharded state; gradients are summed over them once
per step (``hetjax.runtime.update``), and ZeRO-1 splits the optimizer state over them.

Mesh axis names, outermost to innermost, are `MESH_AXES` = ``("pp", "dp", "fsdp", "ep",
"cp", "tp")``; the mesh's ``dp`` axis has size ``dp // ep`` and its ``ep`` axis size
``ep``, so the data batch is sharded over ``("dp", "fsdp", "ep")`` together (consecutive
data ranks, in device order). A pipeline-stage submesh drops ``"pp"`` (`STAGE_AXES`).
"""

from __future__ import annotations

import dataclasses

DEGREES = ("dp", "fsdp", "tp", "cp", "pp", "ep")
MESH_AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")
STAGE_AXES = ("dp", "fsdp", "ep", "cp", "tp")


class LayoutError(ValueError):
    """A module's layout, placement or shapes disagree; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Parallel degrees of one module.

    Example:
        >>> Layout.parse("dp=2,tp=2,pp=2").num_devices
        8
    """

    dp: int = 1  # data-parallel replicas (batch split), experts' groups included
    fsdp: int = 1  # data-parallel ranks that also shard parameters, gradients, optimizer
    tp: int = 1  # tensor-parallel ranks (Megatron column/row splits of weights)
    cp: int = 1  # context-parallel ranks (sequence split)
    pp: int = 1  # pipeline stages (layer stack split)
    ep: int = 1  # expert-parallel ranks inside the data-parallel ranks; divides dp

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"Layout: {name}={value!r} must be a positive int; e.g. {name}=1")
        if self.dp % self.ep:
            raise LayoutError(
                f"Layout({self}): ep={self.ep} must divide dp={self.dp} (experts are grouped"
                f" inside the data-parallel ranks); set ep to a divisor of {self.dp}"
            )

    @classmethod
    def parse(cls, text: str, *, module: str = "module") -> Layout:
        """Parses ``"dp=2,tp=2,pp=2"``; missing degrees are 1, spaces are ignored.

        Args:
            text: comma-separated ``key=int`` pairs with keys from dp, fsdp, tp, cp, pp, ep.
            module: module name used in error messages.

        Returns:
            The layout.

        Raises:
            LayoutError: unknown or repeated key, a value that is not a positive int, or
                ep not dividing dp.
        """
        degrees: dict[str, int] = {}
        for item in text.replace(" ", "").split(","):
            if not item:
                continue
            key, sep, value = item.partition("=")
            if not sep or key not in DEGREES:
                raise LayoutError(
                    f"{module}: cannot parse {item!r} in layout {text!r}; write key=int with"
                    f" keys from {', '.join(DEGREES)}, e.g. 'dp=2,tp=2'"
                )
            if key in degrees:
                raise LayoutError(
                    f"{module}: degree {key} given twice in layout {text!r}; keep one"
                )
            try:
                degrees[key] = int(value)
            except ValueError:
                raise LayoutError(
                    f"{module}: {key}={value!r} in layout {text!r} is not an int; e.g. {key}=2"
                ) from None
        try:
            return cls(**degrees)
        except LayoutError as err:
            raise LayoutError(f"{module}: {err}") from None

    @property
    def num_devices(self) -> int:
        """Devices the module occupies: ``dp * fsdp * tp * cp * pp`` (ep shares the dp
        ranks)."""
        return self.dp * self.fsdp * self.tp * self.cp * self.pp

    @property
    def devices_per_stage(self) -> int:
        """Devices of one pipeline stage: ``dp * fsdp * tp * cp``."""
        return self.dp * self.fsdp * self.tp * self.cp

    @property
    def data_ranks(self) -> int:
        """Slices the batch is split into: ``dp * fsdp`` (experts' groups included)."""
        return self.dp * self.fsdp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of `MESH_AXES` = (pp, dp // ep, fsdp, ep, cp, tp)."""
        return (self.pp, self.dp // self.ep, self.fsdp, self.ep, self.cp, self.tp)

    @property
    def stage_shape(self) -> tuple[int, ...]:
        """Sizes of `STAGE_AXES` = (dp // ep, fsdp, ep, cp, tp)."""
        return self.mesh_shape[1:]

    def __str__(self) -> str:
        # fsdp only where it is set: layouts without it print as they always did.
        shown = [n for n in DEGREES if n != "fsdp" or self.fsdp != 1]
        return ",".join(f"{name}={getattr(self, name)}" for name in shown)
