"""The user's description of a multimodal training graph: modules, layouts, links.

A :class:`ModuleSpec` is one node of the graph with its own parallel layout: a chain of
:class:`hetjax.StagedModule` parts (an encoder and its projector, or the LLM) that is
split into ``layout.pp`` pipeline stages over the FIRST part's block stack; the other
parts run on the last stage. A :class:`Link` says that a module's output feeds another
module's ``pre`` as a keyword argument (``image=...``). The graph's single sink returns
the summed loss from its ``post``.

Frozen parts (``ModuleSpec.frozen``, or :meth:`TrainGraph.freeze` by name) are not
trained. The graph decides from them, per pipeline stage, what the executor runs
(:meth:`TrainGraph.has_backward`, :meth:`TrainGraph.needs_input_grad`): "upstream"
follows the data, encoders before the LLM, a module's parts in order and its stages in
stage order. A stage whose parameters are all frozen and that has nothing trainable
upstream runs forward only (no backward, no stash, no gradient sent back); a frozen
stage downstream of trainable parameters computes activation gradients only.

Activation policy (``ModuleSpec.recompute``, or :meth:`TrainGraph.with_recompute` by
module name): what a trained stage keeps between its forward and its backward, one of
:data:`hetjax.recompute.Recompute` (``none``, the default; ``selective``; ``full``).

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
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from hetjax.meshes import Layout, LayoutError, validate_fsdp
from hetjax.modules import StagedModule
from hetjax.recompute import DEFAULT_RECOMPUTE as DEFAULT_RECOMPUTE
from hetjax.recompute import RECOMPUTE_POLICIES as RECOMPUTE_POLICIES
from hetjax.recompute import Recompute as Recompute


@dataclasses.dataclass(frozen=True)
class ModuleSpec:
    """One module of the graph and its parallel layout."""

    name: str  # layout / island name ("vision", "audio", "llm")
    parts: tuple[StagedModule, ...]  # run in order; parts[0]'s blocks are pipelined
    layout: Layout  # this module's dp / tp / cp / pp / ep
    inputs: tuple[str, ...] = ()  # batch keys passed positionally to parts[0].pre
    input_slots: int = 1  # items per row on dim 1 of each input (a row's image slots);
    # the output's dim 1 is that many equal blocks in slot order (what rebalance deals)
    loss_inputs: tuple[str, ...] = ()  # batch keys passed to the sink's post after h
    block_inputs: tuple[str, ...] = ()  # batch keys passed by name to parts[0]'s blocks on
    # every pipeline stage (packed rows' segment_ids and positions)
    seq_inputs: tuple[str, ...] = ()  # batch keys with a sequence axis (dim 1): with cp > 1
    # they are stored load-balanced (zigzag) and split over cp, like the activations. A
    # module with cp > 1 and no sequence inputs (an encoder inheriting the LLM's CP, as in
    # the homogeneous baseline) splits its own tokens over cp between blocks.
    token_slots: tuple[tuple[str, str, int], ...] = ()  # (link input, sequence batch key,
    # placeholder id): the link's tokens replace that id's positions in order. With
    # cp > 1 each cp rank then receives only the tokens of the positions it stores.
    frozen: frozenset[str] = frozenset()  # names of parts not trained (no gradient,
    # optimizer state or DP reduction)
    recompute: Recompute = DEFAULT_RECOMPUTE  # activation policy: none, selective, full
    unit_cost: Callable[[Mapping[str, np.ndarray]], np.ndarray] | None = None  # a step's
    # host batch -> each input slot's cost [B * input_slots] that rebalance deals by (the
    # Qwen tower's patches per row); None: 1 per nonzero slot (an image)

    def __post_init__(self):
        if not self.parts:
            raise LayoutError(f"{self.name}: a module needs at least one StagedModule part")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise LayoutError(
                f"{self.name}: recompute={self.recompute!r} is not a policy; use one of "
                f"{', '.join(RECOMPUTE_POLICIES)}"
            )
        unknown = sorted(set(self.frozen) - set(self.param_keys))
        if unknown:
            raise LayoutError(
                f"{self.name}: frozen names {unknown}, which are not its parts; use some of "
                f"{list(self.param_keys)}"
            )
        main = self.parts[0]
        if main.num_layers % self.layout.pp:
            raise LayoutError(
                f"{self.name}: {main.num_layers} layers do not split into pp={self.layout.pp} "
                f"equal stages; use a pp that divides {main.num_layers}"
            )
        axes = {p.name: p.logical_axes() for p in self.parts}
        validate_fsdp(
            self.name, self.layout, axes, {p.name: p.abstract_params() for p in self.parts}
        )

    @property
    def param_keys(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    def stage_parts(self, stage: int) -> tuple[str, ...]:
        """Names of the parts with parameters on ``stage`` (the first part on every stage,
        the further parts on the last)."""
        rest = self.param_keys[1:] if stage == self.layout.pp - 1 else ()
        return (self.param_keys[0], *rest)

    def trainable(self, stage: int) -> tuple[str, ...]:
        """Names of the parts trained on ``stage``."""
        return tuple(n for n in self.stage_parts(stage) if n not in self.frozen)

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

        if self.modules and all(set(m.frozen) == set(m.param_keys) for m in self.modules):
            raise LayoutError(
                "freeze names every part, so nothing would train; leave at least one part "
                "out of freeze"
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

    def with_recompute(self, policies: Mapping[str, Recompute]) -> TrainGraph:
        """This graph with the activation policies ``policies`` (module name -> ``none``,
        ``selective`` or ``full``; the key ``*`` sets every module not named).

        Raises:
            LayoutError: an unknown module name or policy, in one line naming the fix.
        """
        names = [m.name for m in self.modules]
        for name, policy in policies.items():
            if name != "*" and name not in names:
                raise LayoutError(
                    f"recompute names unknown module {name!r}; use one of {', '.join(names)} "
                    "(or no module: a bare policy for all)"
                )
            if policy not in RECOMPUTE_POLICIES:
                raise LayoutError(
                    f"recompute {name}:{policy!r} is not a policy; use one of "
                    f"{', '.join(RECOMPUTE_POLICIES)}"
                )
        default = policies.get("*")
        return dataclasses.replace(
            self,
            modules=tuple(
                dataclasses.replace(m, recompute=policies.get(m.name, default or m.recompute))
                for m in self.modules
            ),
        )

    # -- frozen parts -------------------------------------------------------------------

    def freeze(self, names: Iterable[str]) -> TrainGraph:
        """This graph with ``names`` frozen: a part's name freezes that part, a module's
        name that is not also a part's name freezes all its parts (in the MLLM a module is
        named after its first part, so ``vision`` freezes the encoder, not its
        projector)."""
        frozen = frozen_parts(names, {m.name: m.param_keys for m in self.modules})
        return dataclasses.replace(
            self,
            modules=tuple(
                dataclasses.replace(m, frozen=m.frozen | (frozen & set(m.param_keys)))
                for m in self.modules
            ),
        )

    def trains_upstream(self, name: str) -> bool:
        """Whether module ``name`` or any module feeding it (transitively) trains a part."""
        spec = self.module(name)
        return len(spec.frozen) < len(spec.parts) or any(
            self.trains_upstream(l.src) for l in self.links_into(name)
        )

    def needs_input_grad(self, key: tuple[str, int]) -> bool:
        """Whether stage ``key``'s backward must return the gradient of its input: some
        parameter upstream of it trains."""
        name, stage = key
        spec = self.module(name)
        return any(spec.trainable(s) for s in range(stage)) or any(
            self.trains_upstream(l.src) for l in self.links_into(name)
        )

    def stashes_frozen_output(self, key: tuple[str, int]) -> bool:
        """Whether stage ``key`` keeps its frozen first part's output for the backward
        instead of its input: the module's last stage, not the sink, its first part frozen
        with nothing trainable upstream and a later part trained (a frozen encoder under
        its trained projector). Its backward then starts from that output, so the frozen
        encoder runs forward once, never inside the backward."""
        name, stage = key
        spec = self.module(name)
        return (
            name != self.sink
            and stage == spec.layout.pp - 1
            and spec.param_keys[0] in spec.frozen
            and bool(spec.trainable(stage))
            and not self.needs_input_grad(key)
        )

    def has_backward(self, key: tuple[str, int]) -> bool:
        """Whether stage ``key`` runs a backward: it trains a part, or a gradient passes
        through it to trainable parameters upstream. Without one it runs forward only."""
        return bool(self.module(key[0]).trainable(key[1])) or self.needs_input_grad(key)


def frozen_parts(names: Iterable[str], modules: Mapping[str, Sequence[str]]) -> frozenset[str]:
    """The part names that ``names`` freeze (see :meth:`TrainGraph.freeze`), given each
    module's part names; one-line errors for an unknown name or freezing everything."""
    parts = [p for ps in modules.values() for p in ps]
    frozen: set[str] = set()
    for name in names:
        if name in parts:
            frozen.add(name)
        elif name in modules:
            frozen.update(modules[name])
        else:
            raise LayoutError(
                f"freeze names unknown part {name!r}; use modules or parts among {', '.join(parts)}"
            )
    if frozen == set(parts):
        raise LayoutError(
            "freeze names every part, so nothing would train; leave at least one part out of freeze"
        )
    return frozenset(frozen)
