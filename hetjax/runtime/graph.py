"""The user's description of a multimodal training graph: modules, layouts, links.

A :class:`ModuleSpec` is one node of the graph with its own parallel layout: a chain of
:class:`hetjax.StagedModule` parts (an encoder and its projector, or the LLM) that is
split into ``layout.pp`` pipeline stages over the FIRST part's block stack; the other
parts run on the last stage. A :class:`Link` says that a module's output feeds another
module's ``pre`` as a keyword argument (``image=...``). The graph's single sink returns
the summed loss from its ``post``.

Example:
    >>> graph = TrainGraph(
    ...     modules=(
    ...         ModuleSpec("vision", parts=(vit, projector), inputs=("images",),
    ...                    layout=Layout.parse("dp=8")),
    ...         ModuleSpec("llm", parts=(llm,), inputs=("tokens",),
    ...                    loss_inputs=("targets", "loss_mask"),
    ...                    layout=Layout.parse("dp=2,tp=2,pp=2")),
    ...     ),
    ...     links=(Link("vision", "llm", "image"),),
    ... )
"""

from __future__ import annotations

import dataclasses

from hetjax.meshes import Layout, LayoutError
from hetjax.modules import StagedModule


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """One module of the graph and its parallel layout."""

    name: str  # layout / island name ("vision", "audio", "llm")
    parts: tuple[StagedModule, ...]  # run in order; parts[0]'s blocks are pipelined
    layout: Layout  # this module's dp / tp / cp / pp / ep
    inputs: tuple[str, ...] = ()  # batch keys passed positionally to parts[0].pre
    loss_inputs: tuple[str, ...] = ()  # batch keys passed to the sink's post after h
    seq_inputs: tuple[str, ...] = ()  # batch keys with a sequence axis (dim 1): with cp > 1
    # they are stored load-balanced (zigzag) and split over cp, like the activations. A
    # module with cp > 1 and no sequence inputs (an encoder inheriting the LLM's CP, as in
    # the homogeneous baseline) splits its own tokens over cp between blocks.
    token_slots: tuple[tuple[str, str, int], ...] = ()  # (link input, sequence batch key,
    # placeholder id): the link's tokens replace that id's positions in order. With
    # cp > 1 each cp rank then receives only the tokens of the positions it stores.

    def __post_init__(self):
        if not self.parts:
            raise LayoutError(f"{self.name}: a module needs at least one StagedModule part")
        main = self.parts[0]
        if main.num_layers % self.layout.pp:
            raise LayoutError(
                f"{self.name}: {main.num_layers} layers do not split into pp={self.layout.pp} "
                f"equal stages; use a pp that divides {main.num_layers}"
            )

    @property
    def param_keys(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    def stage_layers(self, stage: int) -> tuple[int, int]:
        """Block range ``[start, stop)`` of ``parts[0]`` on pipeline stage ``stage``."""
        per = self.parts[0].num_layers // self.layout.pp
        return stage * per, (stage + 1) * per


@dataclasses.dataclass(frozen=True)
class Link:
    """``src``'s output feeds ``dst``'s first stage as keyword argument ``name``."""

    src: str
    dst: str
    name: str


@dataclasses.dataclass(frozen=True)
class TrainGraph:
    """Modules and links; exactly one sink (the module that returns the loss)."""

    modules: tuple[ModuleSpec, ...]
    links: tuple[Link, ...] = ()

    def __post_init__(self):
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise LayoutError(f"module names must be unique, got {names}")
        for link in self.links:
            for end in (link.src, link.dst):
                if end not in names:
                    raise LayoutError(f"link {link.src}->{link.dst}: unknown module {end!r}")
        sinks = [n for n in names if not any(l.src == n for l in self.links)]
        if len(sinks) != 1:
            raise LayoutError(f"the graph needs exactly one sink module (the loss), got {sinks}")
        for m in self.modules:
            if m.name != sinks[0] and m.loss_inputs:
                raise LayoutError(f"{m.name}: only the sink module {sinks[0]!r} takes loss_inputs")
            links = sorted(l.name for l in self.links_into(m.name))
            for name, key, _ in m.token_slots:
                if name not in links:
                    raise LayoutError(
                        f"{m.name}: token_slots names link input {name!r}, but its links "
                        f"bring {links}; use one of those names"
                    )
                if key not in m.seq_inputs:
                    raise LayoutError(
                        f"{m.name}: token_slots reads placeholders from {key!r}, which is not "
                        f"one of its seq_inputs {list(m.seq_inputs)}; add it there"
                    )

    @property
    def sink(self) -> str:
        return next(m.name for m in self.modules if not any(l.src == m.name for l in self.links))

    def module(self, name: str) -> ModuleSpec:
        return next(m for m in self.modules if m.name == name)

    def links_into(self, name: str) -> tuple[Link, ...]:
        return tuple(l for l in self.links if l.dst == name)

    def links_from(self, name: str) -> tuple[Link, ...]:
        return tuple(l for l in self.links if l.src == name)

    def with_layouts(self, layouts: dict[str, Layout]) -> TrainGraph:
        return dataclasses.replace(
            self,
            modules=tuple(
                dataclasses.replace(m, layout=layouts.get(m.name, m.layout)) for m in self.modules
            ),
        )
