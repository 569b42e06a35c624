"""`ModuleGraph`: the multimodal model as a DAG of modules, each with its own PP degree.

Graph-aware scheduling (the non-colocated mode of the paper) needs three facts about the
model: which modules exist, how many pipeline stages each has, and which module feeds
which. This file holds exactly that, validates it (one clear line per mistake) and
flattens it into global stages. It knows nothing about TP/DP/meshes - those live in
`hetjax.meshes` - so a schedule can be built and checked without any devices.

Flattening rule (as in Megatron's ``MultiModulePipelineCommunicator``): modules are laid
out in topological order (ties broken by declaration order), each module's PP stages
get consecutive global ids, a module's *depth* is the longest PP-weighted path from any
source to it, and the total pipeline depth is the longest PP-weighted path overall,
e.g. ``max(pp_image, pp_audio) + pp_llm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from .actions import Edge
from .schedule import StageInfo


@dataclasses.dataclass(frozen=True, eq=False)
class ModuleGraph:
    """A DAG of modules, each with a pipeline-parallel degree.

    Attributes:
        modules: Module name -> PP degree, in declaration order (read-only).
        edges: ``(src, dst)`` module pairs; activations flow src -> dst.

    Raises:
        ValueError: On an empty graph, a PP degree below 1, an edge naming an unknown
            module, a duplicate edge, an isolated module, a graph with no sink, or a
            cycle. The message names the module and the fix.

    Example:
        >>> g = ModuleGraph({"vision": 2, "audio": 1, "llm": 2},
        ...                 [("vision", "llm"), ("audio", "llm")])
        >>> g.total_stages()
        4
    """

    modules: Mapping[str, int]
    edges: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", MappingProxyType(dict(self.modules)))
        object.__setattr__(self, "edges", tuple((str(s), str(d)) for s, d in self.edges))
        self._validate()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModuleGraph):
            return NotImplemented
        return dict(self.modules) == dict(other.modules) and self.edges == other.edges

    def __hash__(self) -> int:
        return hash((tuple(self.modules.items()), self.edges))

    @classmethod
    def chain(cls, *modules: tuple[str, int]) -> ModuleGraph:
        """A linear graph, e.g. ``ModuleGraph.chain(("vision", 1), ("llm", 2))``."""
        names = [name for name, _ in modules]
        return cls(dict(modules), list(zip(names, names[1:], strict=False)))

    def _validate(self) -> None:
        if not self.modules:
            raise ValueError(
                "module graph is empty; add at least one module, e.g. ModuleGraph({'llm': 2})."
            )
        for name, pp in self.modules.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"module name {name!r} must be a non-empty string.")
            if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
                raise ValueError(
                    f"module {name!r} has pp={pp!r}; a pipeline degree must be an int >= 1 "
                    "(use pp=1 for an unpipelined module)."
                )
        known = ", ".join(self.modules)
        for src, dst in self.edges:
            for name in (src, dst):
                if name not in self.modules:
                    raise ValueError(
                        f"edge {src}->{dst} names unknown module {name!r}; add it to "
                        f"modules or fix the edge (known: {known})."
                    )
        if len(set(self.edges)) != len(self.edges):
            dup = next(e for e in self.edges if self.edges.count(e) > 1)
            raise ValueError(f"edge {dup[0]}->{dup[1]} is listed twice; list each edge once.")
        if len(self.modules) > 1:
            touched = {name for edge in self.edges for name in edge}
            for name in self.modules:
                if name not in touched:
                    raise ValueError(
                        f"module {name!r} has no edges; connect it to the graph or drop it."
                    )
        if not self.sinks:
            raise ValueError(
                "module graph has no sink (every module feeds another), so no module "
                "computes the loss; the LLM must have no outgoing edge."
            )
        self.topological_order()  # raises on a cycle

    def successors(self, module: str) -> tuple[str, ...]:
        """Modules fed by ``module``, in edge declaration order."""
        return tuple(d for s, d in self.edges if s == module)

    def predecessors(self, module: str) -> tuple[str, ...]:
        """Modules feeding ``module``, in declaration order of the modules."""
        preds = {s for s, d in self.edges if d == module}
        return tuple(name for name in self.modules if name in preds)

    @property
    def sources(self) -> tuple[str, ...]:
        """Modules with no incoming edge (the encoders, usually)."""
        return tuple(m for m in self.modules if not self.predecessors(m))

    @property
    def sinks(self) -> tuple[str, ...]:
        """Modules with no outgoing edge (the loss modules, usually the LLM)."""
        return tuple(m for m in self.modules if not self.successors(m))

    def topological_order(self) -> tuple[str, ...]:
        """Modules so that every edge goes forward; ties keep declaration order.

        Raises:
            ValueError: If the graph has a cycle (names the modules on it).
        """
        indegree = {m: len(self.predecessors(m)) for m in self.modules}
        order: list[str] = []
        ready = [m for m in self.modules if indegree[m] == 0]
        while ready:
            module = ready.pop(0)
            order.append(module)
            for nxt in self.successors(module):
                indegree[nxt] -= 1
                if indegree[nxt] == 0:
                    ready.append(nxt)
            ready.sort(key=list(self.modules).index)
        if len(order) != len(self.modules):
            stuck = [m for m in self.modules if m not in order]
            raise ValueError(
                f"module graph has a cycle through {', '.join(stuck)}; remove an edge so "
                "activations flow one way, from the encoders to the LLM."
            )
        return tuple(order)

    def depth(self, module: str) -> int:
        """Longest PP-weighted path from any source to the start of ``module``."""
        depths: dict[str, int] = {}
        for name in self.topological_order():
            depths[name] = max(
                (depths[p] + self.modules[p] for p in self.predecessors(name)), default=0
            )
        return depths[module]

    def height(self, module: str) -> int:
        """Longest PP-weighted path from the start of ``module`` to the end of a sink."""
        heights: dict[str, int] = {}
        for name in reversed(self.topological_order()):
            below = max((heights[s] for s in self.successors(name)), default=0)
            heights[name] = self.modules[name] + below
        return heights[module]

    def total_stages(self) -> int:
        """Longest PP-weighted path through the graph, e.g. max(pp_img, pp_aud) + pp_llm."""
        return max(self.depth(m) + self.modules[m] for m in self.sinks)

    def flatten(self) -> tuple[tuple[StageInfo, ...], tuple[Edge, ...]]:
        """Lay the graph out as global stages and stage-to-stage edges.

        Returns:
            ``(stages, edges)``: stages in topological module order, each module's PP
            stages consecutive; edges between consecutive stages of a module, then from
            each module's last stage to each successor's first stage. Edges into a stage
            are ordered by the source module's declaration order (a join receives in
            that order); edges out of a stage follow edge declaration order.

        Example:
            >>> stages, edges = ModuleGraph.chain(("vision", 1), ("llm", 2)).flatten()
            >>> [str(s) for s in stages], [str(e) for e in edges]
            (['vision[0/1]', 'llm[0/2]', 'llm[1/2]'], ['vision@0->llm@1', 'llm@1->llm@2'])
        """
        first: dict[str, int] = {}
        stages: list[StageInfo] = []
        for module in self.topological_order():
            pp = self.modules[module]
            first[module] = len(stages)
            stages.extend(StageInfo(len(stages), module, i, pp) for i in range(pp))
        edges: list[Edge] = []
        for module in self.topological_order():
            base = first[module]
            for pred in self.predecessors(module):
                src = first[pred] + self.modules[pred] - 1
                edges.append(Edge(pred, src, module, base))
            edges.extend(
                Edge(module, base + i, module, base + i + 1)
                for i in range(self.modules[module] - 1)
            )
        return tuple(stages), tuple(edges)

    def stage_depths(self, *, align: str = "source") -> tuple[int, ...]:
        """Position of every global stage on the longest path (0 = first).

        Args:
            align: ``"source"``: a stage sits right after its longest input path (the
                reference rule, Megatron ``current_stage``); ``"sink"``: a stage sits as
                late as its longest output path allows, so a short branch (an audio
                encoder with pp=1 beside a pp=2 vision encoder) starts later and holds
                fewer activations.

        Returns:
            One depth per global stage of `flatten`, each in ``[0, total_stages())``.
        """
        if align not in ("source", "sink"):
            raise ValueError(f"align must be 'source' or 'sink', not {align!r}.")
        total = self.total_stages()
        stages, _ = self.flatten()
        out = []
        for info in stages:
            if align == "source":
                out.append(self.depth(info.module) + info.index)
            else:
                out.append(total - self.height(info.module) + info.index)
        return tuple(out)
