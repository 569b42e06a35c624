"""Rows of a step: samples placed in ``seq_len`` rows (packed or not), rows placed in bins.

A row holds ``L + 1`` stored tokens (inputs are ``[:-1]``, targets ``[1:]``) and
``images_per_row`` image slots; its samples' images fill the slots in order, so the
``k``-th image placeholder of a row takes the ``k``-th image's tokens whatever sample it
belongs to. Unused slots hold zero images: no placeholder takes their tokens, so they
get no gradient.

The executor cuts microbatch ``m`` as rows ``[m * B/M, (m+1) * B/M)`` and gives data-
parallel rank ``r`` of degree ``d`` the ``r``-th contiguous ``1/d`` of it, so a coarser
rank holds consecutive bins of a finer one. :func:`assign` orders rows into those bins
greedily (the heaviest row into the lightest bin with room): tokens for the LLM's ranks,
images for the encoder's. Shapes stay static, so balancing evens the real (unpadded)
work each rank's rows carry; it pays where kernels skip padding and masked images.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def supervised_targets(supervised: np.ndarray) -> int:
    """The loss-mask positions a sample of stored supervision ``supervised`` fills in any
    row: its first token is never a target within the sample (a row's first is no
    target; packed, it would be predicted from the previous sample)."""
    return int(np.count_nonzero(supervised[1:]))


def attention_segments(samples_per_row: int) -> int:
    """The runs of equal segment ids a row of at most ``samples_per_row`` samples has: one
    per sample, and the trailing padding's (segment id 0) where the row is not full. The
    bound the fused attention's packed layout is built for
    (:func:`hetjax.ops.fused_attention.packed_segments`)."""
    return samples_per_row + 1


class Packer:
    """First-fit rows: ``add(sample)`` places it or returns ``False`` (it fits no row).

    ``loss_tokens``: a row's most supervised targets (the loss head's per-row budget,
    ``None``: unbounded); ``samples``: a row's most samples (``None``: unbounded). A packed
    row takes a sample only while these fit too."""

    def __init__(
        self,
        num_rows: int,
        capacity: int,
        slots: int,
        *,
        pack: bool,
        loss_tokens: int | None = None,
        samples: int | None = None,
    ):
        self.num_rows, self.capacity, self.slots, self.pack = num_rows, capacity, slots, pack
        self.loss_tokens = capacity if loss_tokens is None else loss_tokens
        self.samples = capacity if samples is None else samples  # capacity: no sample is empty
        self.rows: list[list] = []
        self.used: list[list[int]] = []  # [tokens, images, supervised targets, samples] per row
        self.pending: list[tuple[int, int, object]] = []  # set by arrays()

    @property
    def full(self) -> bool:
        return not self.pack and len(self.rows) == self.num_rows

    def add(self, sample, slots: int | None = None) -> bool:
        """Places ``sample``; it takes ``slots`` of its row's (default one per image;
        Qwen2.5-VL's rows: one per patch)."""
        slots = len(sample.images) if slots is None else slots
        row = self.place(len(sample.ids), slots, supervised_targets(sample.supervised))
        if row is None:
            return False
        self.rows[row].append(sample)
        return True

    def place(self, tokens: int, images: int, supervised: int = 0) -> int | None:
        """The row a sample of ``tokens``, ``images`` and ``supervised`` targets goes to,
        its load counted there
        (a new row if none takes it), or ``None`` when no row can (nothing changes).
        :meth:`add` without storing the sample: what measuring a packing needs."""
        target = None
        if self.pack:
            target = next(
                (
                    r
                    for r, (t, i, n, k) in enumerate(self.used)
                    if t + tokens <= self.capacity
                    and i + images <= self.slots
                    and n + supervised <= self.loss_tokens
                    and k < self.samples
                ),
                None,
            )
        if target is None:
            if len(self.rows) == self.num_rows:
                return None
            self.rows.append([])
            self.used.append([0, 0, 0, 0])
            target = len(self.rows) - 1
        for k, n in enumerate((tokens, images, supervised, 1)):
            self.used[target][k] += n
        return target

    def arrays(
        self, *, pad_id: int, shape: tuple[int, ...] | None
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The batch arrays and each row's load ``[R, 2]`` (input tokens, images).

        Images not decoded yet (not arrays) stay zeros; :attr:`pending` then lists them
        as ``(row, slot, image)``."""
        r, c, k = self.num_rows, self.capacity, self.slots
        self.pending = []
        ids = np.full((r, c), pad_id, np.int32)
        sup = np.zeros((r, c), np.float32)
        segments = np.zeros((r, c), np.int32)
        positions = np.zeros((r, c), np.int32)
        images = None if shape is None else np.zeros((r, k, *shape), np.float32)
        loads = np.zeros((r, 2), np.int64)
        for row, samples in enumerate(self.rows):
            at, slot = 0, 0
            for seg, s in enumerate(samples, start=1):
                n = len(s.ids)
                ids[row, at : at + n] = s.ids
                sup[row, at : at + n] = s.supervised
                segments[row, at : at + n] = seg
                positions[row, at : at + n] = np.arange(n)
                for im in s.images:
                    if isinstance(im, np.ndarray):
                        images[row, slot] = im
                    else:  # decoded later, if a local device holds the row
                        self.pending.append((row, slot, im))
                    slot += 1
                at += n
            loads[row] = (min(at, c - 1), slot)
        out = {"tokens": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": sup[:, 1:]}
        if self.pack:
            # A sample's last input token would predict the next sample's first: never
            # supervised, as when it ends its own row (its target is padding).
            out["loss_mask"] = sup[:, 1:] * (segments[:, 1:] == segments[:, :-1])
            out.update(segment_ids=segments[:, :-1], positions=positions[:, :-1])
        if images is not None:
            out["images"] = images[:, 0] if k == 1 else images
        return out, loads


def packed_images(samples: Iterable[tuple[int, int]], num_rows: int, capacity: int) -> list[int]:
    """Images per row when ``(tokens, images)`` samples pack as the loader packs them (first
    fit over a step's ``num_rows`` rows of ``capacity`` tokens; a step ends at the first
    sample no row takes, which starts the next), with no limit on a row's images.

    Counts the rows of the steps that filled; the last, unfinished step counts only when
    no step filled (its later rows would still take samples)."""
    rows = packed_rows(((n, k, 0) for n, k in samples), num_rows, capacity, capacity)
    return [r[1] for r in rows]


def packed_rows(
    samples: Iterable[tuple[int, int, int]],
    num_rows: int,
    capacity: int,
    slots: int,
    *,
    loss_tokens: int | None = None,
) -> list[list[int]]:
    """``[tokens, images, supervised targets, samples]`` per row when ``(tokens, images,
    supervised)`` samples pack as the loader packs them with ``slots`` image slots, the
    loss budget ``loss_tokens`` (``None``: none) and no limit on a row's samples (the rows
    :func:`packed_images` counts)."""
    done: list[list[int]] = []
    new = lambda: Packer(num_rows, capacity, slots, pack=True, loss_tokens=loss_tokens)
    packer = new()
    for sample in samples:
        if packer.place(*sample) is None:
            done += packer.used
            packer = new()
            packer.place(*sample)
    return done or packer.used


def assign(loads: np.ndarray, bins: tuple[int, int, int], *, balance: bool) -> np.ndarray:
    """Row order for ``bins = (microbatches, encoder dp, llm dp)`` (identity without
    ``balance``, or when the rows do not split evenly into the bins).

    Two levels: the module with fewer dp ranks is balanced first over ``microbatches x
    its dp`` bins (the LLM on tokens, an encoder on images), then each of its bins is
    split over the finer module's ranks on that module's load."""
    r = len(loads)
    m, dv, dl = bins
    if not balance or r % (m * max(dv, dl)):
        return np.arange(r)
    (coarse, c_key), (fine, f_key) = sorted([(dl, 0), (dv, 1)])  # tokens: 0, images: 1
    order: list[int] = []
    for group in _greedy(np.arange(r), loads[:, c_key], m * coarse):
        for part in _greedy(group, loads[group, f_key], fine // coarse):
            order.extend(part.tolist())
    return np.asarray(order)


def _greedy(rows: np.ndarray, weights: np.ndarray, nbins: int) -> list[np.ndarray]:
    """``rows`` in ``nbins`` equal-count bins: heaviest first into the lightest open bin."""
    per = len(rows) // nbins
    load = np.zeros(nbins)
    members: list[list[int]] = [[] for _ in range(nbins)]
    for i in np.argsort(-weights, kind="stable"):
        b = min((b for b in range(nbins) if len(members[b]) < per), key=lambda b: (load[b], b))
        members[b].append(int(rows[i]))
        load[b] += weights[i]
    return [np.asarray(b) for b in members]


def imbalance(values: np.ndarray, microbatches: int, dp: int) -> float:
    """max / mean of ``values`` summed per (microbatch, dp rank) cell (1.0 when even)."""
    cells = values.reshape(microbatches, dp, -1).sum(axis=2)
    mean = cells.mean()
    return float(cells.max() / mean) if mean > 0 else 1.0


def metrics(loads: np.ndarray, bins: tuple[int, int, int], seq_len: int) -> dict[str, float]:
    """``padding_fraction``, ``image_imbalance``, ``token_imbalance``, ``tokens_per_step``."""
    m, dv, dl = bins
    r = len(loads)
    out = {
        "padding_fraction": 1.0 - float(loads[:, 0].sum()) / (r * seq_len),
        "tokens_per_step": float(loads[:, 0].sum()),
        "images_per_step": float(loads[:, 1].sum()),
    }
    if r % (m * dv) == 0 and r % (m * dl) == 0:
        out["image_imbalance"] = imbalance(loads[:, 1], m, dv)
        out["token_imbalance"] = imbalance(loads[:, 0], m, dl)
    return out
