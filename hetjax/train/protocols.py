"""What the :class:`~hetjax.train.Trainer` needs from a model and from its data.

Two small protocols instead of a base class: a user wraps their own Flax modules in any
object with these members (the LLaVA MLLM's is :class:`models.llava.task.LlavaTask`),
and the trainer calls nothing else. Optional members are looked up with ``getattr``; the
docstrings say what a model or data source without them loses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from hetjax.meshes import Layout
from hetjax.runtime.graph import TrainGraph


@runtime_checkable
class TrainableModel(Protocol):
    """A multi-module model the trainer can lay out and train.

    Required:
        module_names: layout names, the sink (the module whose output is the loss)
            last; a module without a layout gets the sink's.
        validate_layouts(layouts): raises ``ValueError`` (one line naming the module and
            the fix) for a layout the model's shapes do not divide.
        train_graph(layouts, freeze=): the :class:`~hetjax.TrainGraph` with these
            layouts; ``freeze`` names modules or parts not trained. (The trainer applies
            the recompute policies itself: :meth:`TrainGraph.with_recompute`.)
        init(key): fresh parameters keyed by part name.

    Optional:
        initial_params(key, lead=): parameters to start from when they are not fresh
            (pretrained weights); default :meth:`init`.
        loss_sum(params, batch) and logical_axes(frozen): the reference trainer
            (``parallel.reference``) needs both.
        flop_metrics(trainer): ``(supervised tokens, step time) -> FLOP metrics`` for MFU.
        metadata(): what a checkpoint records about the model (JSON-able).
        summary(): lines of the end-of-run summary (``{name: value}``).
        describe(): the summary's model line.
        seq_len: tokens per sample, for tokens/s (without it tokens/s reads 0).
    """

    @property
    def module_names(self) -> Sequence[str]: ...

    def validate_layouts(self, layouts: Mapping[str, Layout]) -> None: ...

    def train_graph(
        self, layouts: Mapping[str, Layout], *, freeze: Sequence[str] = ()
    ) -> TrainGraph: ...

    def init(self, key: jax.Array) -> Any: ...


@runtime_checkable
class BatchSource(Protocol):
    """One global batch per step (numpy arrays keyed by the graph's input names).

    Every process builds the same global batch; the trainer keeps this process's shards.

    Optional members:
        start(trainer, state): called once the run is planned and the engine built,
            before the first batch, with the position a resumed checkpoint stored (or
            ``None``): a source that balances rows per data-parallel rank, or decodes only
            this process's rows, reads the plan there.
        step_metrics(step): metrics of step ``step``'s batch (padding, imbalance, ...).
        checkpoint(): the position after the last batch handed out, stored in checkpoints
            (default: the next step, i.e. a source that is a function of the step).
        summary(): one line for the end-of-run summary.
        close(): stop loader threads.
    """

    def batch(self, step: int) -> Mapping[str, Any]: ...
