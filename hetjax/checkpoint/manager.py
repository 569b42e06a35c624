"""Saving and restoring training state with orbax, in the logical format.

:class:`Checkpointer` wraps ``orbax.checkpoint.CheckpointManager``: each checkpoint is a
step directory holding ``state`` (parameters and optimizer state, see
:mod:`hetjax.checkpoint.logical`) and ``meta`` (JSON: the step, the data position, the
RNG seed, the resolved config, the model's parameter shapes). In a multi-process run, the
arrays that only some processes hold (a pipeline stage on one process's devices) go to a
third item, ``owned``, that their owners write themselves (:mod:`hetjax.checkpoint.owned`;
orbax's array handler saves only arrays that every process holds part of); the rest of
the tree keeps a placeholder there, and ``meta`` names them. Saves are asynchronous:
``save`` returns once the arrays are copied to host memory and the files are written in
the background (the next step may then donate the buffers). Orbax writes into a
temporary directory and renames it when complete, so a kill during a save leaves
nothing a restore would load; only the ``keep`` most recent complete checkpoints stay.

Any checkpoint restores into any trainer of the same model: an :class:`hetjax.Executor`
of any layout (the arrays are read straight into its shardings; each process reads only
the slices its devices hold) or a :class:`hetjax.ReferenceTrainer`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from hetjax.checkpoint import logical as lg
from hetjax.checkpoint import owned as ow
from hetjax.files import ensure_writable_dir


class CheckpointError(ValueError):
    """A checkpoint directory or its contents cannot be used; the message names the fix."""


def _is_executor(trainer: Any) -> bool:
    return hasattr(trainer, "abstract_state")


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _flat(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(_path_name(path), leaf) for path, leaf in flat], treedef


def named(tree: Any) -> dict[str, Any]:
    """``{"vit/blocks/attn/qkv": leaf, ...}``: each leaf by its path."""
    return dict(_flat(tree)[0])


def shapes(tree: Any) -> dict[str, list[int]]:
    """``{"vit/blocks/attn/qkv": [4, 64, 192], ...}``: each leaf's path and shape."""
    return {name: [int(n) for n in leaf.shape] for name, leaf in named(tree).items()}


def _held_by_some(x: Any) -> bool:
    """A global array that some processes hold no shard of (orbax cannot save it)."""
    if not isinstance(x, jax.Array):
        return False
    return len({d.process_index for d in x.sharding.device_set}) < jax.process_count()


_PLACEHOLDER = np.zeros((), np.int8)  # in ``state`` where a leaf lives in ``owned``


def _without(tree: Any, names: set[str]) -> Any:
    """``tree`` with the leaves named ``names`` replaced by the placeholder."""
    if not names:
        return tree
    flat, treedef = _flat(tree)
    return jax.tree.unflatten(treedef, [_PLACEHOLDER if n in names else x for n, x in flat])


def _with(tree: Any, leaves: Mapping[str, Any]) -> Any:
    """``tree`` with the leaves named in ``leaves`` put back."""
    if not leaves:
        return tree
    flat, treedef = _flat(tree)
    return jax.tree.unflatten(treedef, [leaves.get(n, x) for n, x in flat])


class Checkpointer:
    """Asynchronous logical checkpoints of one run in ``directory``.

    Args:
        directory: where step directories go (created if missing).
        keep: the most recent complete checkpoints kept.
        async_save: write files in the background (the loop waits only for the copy of
            the arrays to host memory).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        if keep < 1:
            raise CheckpointError(f"keep={keep} must be at least 1")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint dir {self.directory} is a file; give a directory")
        _check_writable(self.directory)
        _single_writer_arrays()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True
            ),
            item_names=("state", "meta", "owned"),
        )
        if self._manager.latest_step() is None and _foreign(self.directory):
            raise CheckpointError(
                f"{self.directory} is not a hetjax checkpoint directory (it holds other "
                "files and no checkpoint); give an empty or new directory"
            )

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, trainer: Any, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Starts saving ``trainer``'s state as step ``step`` (returns before the writes)."""
        state = (
            lg.executor_logical(trainer) if _is_executor(trainer) else lg.reference_logical(trainer)
        )
        owned = {n: x for n, x in named(state).items() if _held_by_some(x)}
        meta = {
            "step": int(step),
            "shapes": shapes(state["params"]),
            "trained": lg.trained_parts(trainer),
            **({"owned": sorted(owned)} if owned else {}),
            **json.loads(json.dumps(dict(metadata or {}), default=str)),
        }
        items = {
            "state": ocp.args.StandardSave(_without(state, set(owned))),
            "meta": ocp.args.JsonSave(meta),
        }
        if owned:
            items["owned"] = ow.OwnedSave(owned)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of checkpoint ``step`` (default: the latest)."""
        step = self._step(step)
        try:
            got = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; report one line
            raise CheckpointError(
                f"checkpoint {self.path(step)} is damaged ({type(e).__name__}); delete it to "
                "resume from an earlier one"
            ) from None
        return dict(got["meta"])

    def restore(self, trainer: Any, *, step: int | None = None) -> dict[str, Any]:
        """Restores checkpoint ``step`` (default: the latest) into ``trainer``.

        Returns:
            The checkpoint's metadata.

        Raises:
            CheckpointError: no checkpoint, a checkpoint of another model (naming the
                first leaf whose shape differs), or a damaged one.
        """
        step = self._step(step)
        meta = self.metadata(step)
        executor = _is_executor(trainer)
        targets = lg.executor_targets(trainer) if executor else lg.reference_targets(trainer)
        _check_shapes(meta.get("shapes", {}), shapes(targets["params"]), self.path(step))
        _check_trained(meta.get("trained"), lg.trained_parts(trainer), self.path(step))
        owned = set(meta.get("owned", ()))
        state = self._read(
            step,
            ocp.args.StandardRestore(_without(targets, owned)),
            {n: t for n, t in named(targets).items() if n in owned},
            "delete it to resume from an earlier one",
        )
        if executor:
            trainer.state = lg.executor_state(trainer, state, int(meta["step"]))
        else:
            trainer.params, trainer.opt_state = lg.reference_state(trainer, state)
        return meta

    def restore_params(self, like: Any, *, step: int | None = None) -> Any:
        """Only the parameters of checkpoint ``step`` (default: the latest), read into the
        shardings of ``like`` (a tree of ``jax.ShapeDtypeStruct`` with ``sharding``, in
        the single-device layout); no trainer and no optimizer state are needed (export).
        Each leaf comes in ``like``'s dtype (a frozen part saved in bf16 reads as float32).
        """
        step = self._step(step)
        meta = self.metadata(step)
        _check_shapes(meta.get("shapes", {}), shapes(like), self.path(step))
        wanted = named({"params": like})
        owned = set(meta.get("owned", ())) & set(wanted)
        like = _without({"params": like}, owned)
        restore_args = jax.tree.map(
            lambda a: (
                ocp.RestoreArgs(restore_type=np.ndarray)
                if a is _PLACEHOLDER
                else ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype)
            ),
            like,
        )
        state = self._read(
            step,
            ocp.args.PyTreeRestore(like, restore_args=restore_args, partial_restore=True),
            {n: wanted[n] for n in sorted(owned)},
            "delete it or export an earlier step",
        )
        return state["params"]

    def _read(self, step: int, args: Any, owned: Mapping[str, Any], fix: str) -> Any:
        """Item ``state`` (orbax, with ``args``) with the ``owned`` leaves put back.

        The owned leaves are read outside orbax's restore, after it: each process reads
        only its own slices, so damage there fails on one process alone, and orbax's
        restore must run alike on every process. Every process then stops alike.
        """
        got, error = None, None
        try:
            got = self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]
            if owned:
                got = _with(got, ow.read(self.path(step) / "owned", dict(owned)))
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
            error = (
                f"checkpoint {self.path(step)} is damaged or incomplete ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:160]}); {fix}"
            )
        error = _first_error(error)
        if error is not None:
            raise CheckpointError(error)
        return got

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise CheckpointError(
                f"no checkpoint {'' if step is None else step} in {self.directory}"
            )
        return step


def _first_error(error: str | None) -> str | None:
    """Multi-process: the first process's error, on every process. Each process reads only
    its own slices, so damage one process reads fails there alone; all must stop alike."""
    if jax.process_count() == 1:
        return error
    from jax.experimental import multihost_utils

    blob = np.zeros(_ERROR_BYTES, np.uint8)
    mine = (error or "").encode()[:_ERROR_BYTES]
    blob[: len(mine)] = np.frombuffer(mine, np.uint8)
    for row in multihost_utils.process_allgather(blob):
        if row.any():
            return bytes(row).rstrip(b"\0").decode(errors="replace")
    return None


_ERROR_BYTES = 512


def _check_writable(directory: Path) -> None:
    """Creates ``directory`` and writes a probe file, so a bad directory fails now, not
    at the first save after hours of training."""
    try:
        ensure_writable_dir(directory)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint dir {directory} is not writable ({e.strerror or type(e).__name__}); "
            "give a directory you can write"
        ) from None


def _single_writer_arrays() -> None:
    """In one process, write each array's shards from one replica, as orbax does on GPU.

    Orbax's default on CPU splits replicated shards over their replicas with eager
    slices, which compiles hundreds of tiny programs on the first save (7.5 s blocking
    for ``tiny`` instead of 0.15 s). That split only pays across hosts, where each host
    writes its part; with several processes orbax's default stays.
    """
    global _SINGLE_WRITER
    if _SINGLE_WRITER or jax.process_count() > 1:
        return
    absl = logging.getLogger("absl")  # orbax warns on every override of its default
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
        )
    finally:
        absl.setLevel(level)
    _SINGLE_WRITER = True


_SINGLE_WRITER = False  # registered in this process


def _foreign(directory: Path) -> bool:
    """Whether ``directory`` holds files that are not orbax's (nor its temporaries)."""
    if not directory.is_dir():
        return False
    return any(not p.name.startswith(".") and not _orbax_entry(p) for p in directory.iterdir())


def _orbax_entry(p: Path) -> bool:
    name = p.name.split(".orbax-checkpoint-tmp")[0]
    return p.is_dir() and name.isdigit() or "orbax" in p.name or p.name.endswith("metadata")


def _check_shapes(saved: Mapping[str, list], wanted: Mapping[str, list], where: Path) -> None:
    fix = "resume with the same model or start a new checkpoint dir"
    for name in sorted(set(saved) | set(wanted)):
        a, b = saved.get(name), wanted.get(name)
        if a is None:
            raise CheckpointError(
                f"checkpoint {where} is of another model: it has no parameter {name} "
                f"{tuple(b)}; {fix}"
            )
        if b is None:
            raise CheckpointError(
                f"checkpoint {where} is of another model: its parameter {name} {tuple(a)} is "
                f"not in this model; {fix}"
            )
        if a != b:
            raise CheckpointError(
                f"checkpoint {where} is of another model: parameter {name} has shape "
                f"{tuple(a)} there but {tuple(b)} here; {fix}"
            )


def _check_trained(saved: list[str] | None, wanted: list[str], where: Path) -> None:
    """The optimizer state covers the trained parts only, so a checkpoint restores into a
    trainer that trains the same parts. (Which dtype a frozen part is held in does not
    matter: the restore casts each leaf to the trainer's.)"""
    if saved is None or saved == wanted:  # older checkpoints name none
        return
    raise CheckpointError(
        f"checkpoint {where} trained {', '.join(saved)} but this run trains "
        f"{', '.join(wanted)}, so its optimizer state does not fit; resume with the same "
        "frozen parts (model.freeze), or export its parameters (experiments.export) and "
        "start a new run from them (model.init_from)"
    )


def save(directory: str | os.PathLike, trainer: Any, step: int, **kwargs: Any) -> None:
    """Saves ``trainer``'s state as ``step`` in ``directory`` and waits for it."""
    ckpt = Checkpointer(directory, async_save=False)
    ckpt.save(step, trainer, metadata=kwargs.get("metadata"))
    ckpt.close()


def restore(directory: str | os.PathLike, trainer: Any, *, step: int | None = None) -> dict:
    """Restores the latest (or ``step``'s) checkpoint in ``directory`` into ``trainer``."""
    ckpt = Checkpointer(directory)
    try:
        return ckpt.restore(trainer, step=step)
    finally:
        ckpt.close()
