"""Collectives of a compiled program, read from its HLO text.

``jit(f).lower(*args).compile().as_text()`` is the program XLA actually runs, after SPMD
partitioning and its own passes, so it is where tests and benchmarks count what a layout
communicates. This module is the one parser of that text: every collective instruction
becomes a :class:`Collective` with its kind, its bytes per device, its replica groups
(device positions in the program's mesh) and how often it runs per program run (the trip
counts of the ``while`` loops around it: scanned layers, ``fori_loop``).

Unlike ``compiled.cost_analysis()``, which reports one number per program, this keeps
each collective separate, so a caller can ask which mesh axes it spans
(:func:`varied_axes`) or which arrays it reduces (:func:`dp_all_reduce_shapes`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    ``nbytes`` is the full buffer per device and execution: an all-gather's result, a
    reduce-scatter's operand, the operand (= result) of the others. XLA:CPU has no
    reduce-scatter pass: there a reduce-scatter stays an all-reduce followed by a dynamic
    slice, and is read as an all-reduce.
    """

    kind: str  # one of KINDS (an async ``-start`` is read as its kind)
    nbytes: int  # full buffer per device and execution (see above)
    shapes: tuple[tuple[int, ...], ...]  # result array shapes (several if combined)
    groups: tuple[tuple[int, ...], ...]  # replica groups, or a permute's (source, target)
    executions: int  # per program run: product of the enclosing loops' trip counts
    line: str  # the HLO instruction, for error messages
    dtypes: tuple[str, ...] = ()  # HLO element types of ``shapes`` (``f32``, ``bf16``)


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_OP = re.compile(
    r"=\s*(.*?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(-start|-done)?\("
)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"\}')
_CALLS = re.compile(r"(?:calls|to_apply|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(\{[0-9, {}]*\})\}")
_GROUPS = re.compile(r"replica_groups=(\{\{[0-9,{} ]*\}\}|\{\})")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?|[0-9, ]+)\))?\s*\{([^}]*)\}"
)
_BRACED = re.compile(r"\{([0-9, ]+)\}")
_BITS = {"pred": 8, "s4": 4, "u4": 4}


def _itemsize(dtype: str) -> float:
    """Bytes per element of an HLO element type (``f32``, ``bf16``, ``pred``, ``f8e4m3fn``)."""
    if dtype in _BITS:
        return _BITS[dtype] / 8
    bits = re.search(r"[0-9]+", dtype)
    return int(bits.group()) / 8 if bits else 0.0  # token[]: no data


def _arrays(text: str) -> list[tuple[tuple[int, ...], int, str]]:
    """(shape, bytes, element type) of every array type in an HLO type string (tuples
    flattened)."""
    out = []
    for dtype, dims in _ARRAY.findall(text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        out.append((shape, int(math.prod(shape) * _itemsize(dtype)), dtype))
    return out


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Computation name -> its instruction lines, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            if m := _HEADER.match(line):
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _executions(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per program run (while bodies x trip count).

    HLO text prints callees before callers, so walking the computations backwards from
    the entry visits every caller before its callees.
    """
    runs: dict[str, int] = defaultdict(int)
    runs[entry] = 1
    for name in reversed(list(comps)):
        if not runs[name]:
            continue
        for line in comps[name]:
            if m := _WHILE.search(line):
                t = _TRIP.search(line)
                runs[m.group(1)] += runs[name] * (int(t.group(1)) if t else 1)
            for callee in _CALLS.findall(line):
                runs[callee] += runs[name]
            if b := _BRANCHES.search(line):
                for callee in b.group(1).split(","):
                    runs[callee.strip().lstrip("%")] += runs[name]
    return runs


def replica_groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The replica groups of one HLO collective, in any of XLA's three spellings.

    Args:
        line: one HLO instruction, e.g. ``... all-reduce(...), replica_groups={{0,1},{2,3}}``;
            also ``replica_groups=[2,4]<=[4,2]T(1,0)`` (iota) and
            ``replica_groups=mesh[x=2,y=4]{y}`` (mesh axes).
        num_devices: devices of the program (``replica_groups={}`` means all of them).

    Returns:
        One tuple of device positions (in the program's device order) per group.

    Raises:
        ValueError: the line has no replica groups this parser can read.
    """
    if m := _GROUPS.search(line):
        if m.group(1) == "{}":
            return (tuple(range(num_devices)),)
        return tuple(tuple(_ints(g)) for g in _BRACED.findall(m.group(1)[1:-1]))
    if m := _IOTA.search(line):
        shape = _ints(m.group(1))
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        return tuple(tuple(g) for g in ids.reshape(shape).tolist())
    if m := _MESH.search(line):
        axes = [a.split("=") for a in m.group(1).split(",")]
        names, sizes = [n.strip("'") for n, _ in axes], [int(s) for _, s in axes]
        order = m.group(2)
        if order is None:
            flat = np.arange(math.prod(sizes))
        elif order.startswith("["):
            dims, _, perm = order.partition("T")
            flat = _iota(_ints(dims[1:-1]), _ints(perm[1:-1]) if perm else None).ravel()
        else:
            flat = np.asarray(_ints(order))
        grouped = [names.index(a.strip().strip("'")) for a in m.group(3).split(",") if a.strip()]
        kept = [i for i in range(len(names)) if i not in grouped]
        ids = flat.reshape(sizes).transpose(kept + grouped)
        size = math.prod(sizes[i] for i in grouped)
        return tuple(tuple(g) for g in ids.reshape(-1, size).tolist())
    raise ValueError(f"cannot parse the replica groups of: {line.strip()[:200]}")


def _groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    if m := _PAIRS.search(line):
        return tuple(tuple(_ints(p)) for p in _BRACED.findall(m.group(1)))
    return replica_groups(line, num_devices)


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective of a compiled program's HLO text, with its loop multiplicity.

    Args:
        hlo_text: ``compiled.as_text()``.
        num_devices: devices of the program (for replica groups written as ``{}``).

    Returns:
        One :class:`Collective` per instruction, in text order (the ``-done`` halves of
        async pairs skipped).

    Example:
        >>> hlo = jax.jit(f).lower(x).compile().as_text()  # doctest: +SKIP
        >>> bytes_by_kind(collectives(hlo, mesh.size))  # doctest: +SKIP
        {'all-reduce': 4096, 'all-gather': 0, ...}
    """
    comps, entry = _computations(hlo_text)
    runs = _executions(comps, entry)
    out = []
    for name, lines in comps.items():
        for line in lines:
            m = _OP.search(line)
            if not m or m.group(3) == "-done":
                continue
            kind, arrays = m.group(2), _arrays(m.group(1))
            if m.group(3) == "-start" and kind != "all-reduce":
                arrays = [max(arrays, key=lambda a: a[1])]  # (operand, result, ...) tuple
            groups = _groups(line, num_devices)
            nbytes = sum(a[1] for a in arrays)
            if kind == "reduce-scatter":
                nbytes *= max(len(g) for g in groups)
            out.append(
                Collective(
                    kind,
                    nbytes,
                    tuple(a[0] for a in arrays),
                    groups,
                    max(runs[name], 1),
                    line.strip()[:300],
                    tuple(a[2] for a in arrays),
                )
            )
    return out


def _coordinates(mesh: Any) -> np.ndarray:
    """``[devices, axes]``: each mesh position's coordinate along every axis."""
    return np.stack(np.unravel_index(np.arange(mesh.size), mesh.devices.shape), axis=1)


def varied_axes(collective: Collective, mesh: Any) -> set[str]:
    """Mesh axes whose coordinate differs inside one of ``collective``'s groups.

    Args:
        collective: a collective of a program compiled for ``mesh``.
        mesh: a ``jax.sharding.Mesh`` (anything with ``devices``, ``size``, ``axis_names``).

    Returns:
        The names of the axes the collective communicates over (size-1 axes never vary).
    """
    coords = _coordinates(mesh)
    axes = set()
    for group in collective.groups:
        pts = coords[list(group)]
        axes.update(a for i, a in enumerate(mesh.axis_names) if len(set(pts[:, i].tolist())) > 1)
    return axes


def bytes_by_kind(items: Iterable[Collective]) -> dict[str, int]:
    """Bytes per device for one program run, by kind (every kind present, maybe 0)."""
    out = dict.fromkeys(KINDS, 0)
    for c in items:
        out[c.kind] += c.nbytes * c.executions
    return out


def dp_all_reduce_shapes(
    hlo_text: str, mesh: Any, replica_axes: Sequence[str] = ("dp", "ep")
) -> Counter:
    """Operand shapes of the all-reduces that cross data-parallel replicas of ``mesh``.

    An all-reduce crosses replicas when one of its groups spans devices with different
    coordinates along ``replica_axes`` (tensor-parallel all-reduces of activations do
    not). Counts are static: an all-reduce inside a loop body counts once.

    Args:
        hlo_text: ``compiled.as_text()`` of a program compiled for ``mesh``.
        mesh: the program's ``jax.sharding.Mesh``.
        replica_axes: the mesh axes over which parameters are replicated (absent ones
            are ignored).

    Returns:
        Shape -> how many arrays of that shape such all-reduces reduce.
    """
    coords = _coordinates(mesh)
    dims = [mesh.axis_names.index(a) for a in replica_axes if a in mesh.axis_names]
    replica_of = [tuple(c[dims]) for c in coords]
    shapes: Counter = Counter()
    for c in collectives(hlo_text, mesh.size):
        if c.kind == "all-reduce" and any(len({replica_of[d] for d in g}) > 1 for g in c.groups):
            shapes.update(c.shapes)
    return shapes


# An instruction's name and (first) result array; a tuple result, such as a cuBLAS
# gemm's ``(bf16[m,n], s8[workspace])``, gives its first element.
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?[a-z][a-z0-9]*\[([0-9,]*)\]")
# An operand, printed with or without its shape: ``%a`` or ``bf16[8,4]{1,0} %a``.
_OPERAND = r"(?:[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?\s+)?%([\w.\-]+)"
_DOT = re.compile(rf"\sdot\({_OPERAND},.*?lhs_contracting_dims=\{{([0-9,]*)\}}")
# XLA:GPU rewrites most dots into cuBLAS(Lt) calls; the contraction is in the call's
# backend config (``"lhs_contracting_dimensions":["1"]``).
_GEMM = re.compile(
    rf'\scustom-call\({_OPERAND},.*?custom_call_target="__cublas\$(?:lt\$)?(?:gemm|matmul)'
    r'[^"]*".*?"lhs_contracting_dimensions":\[([0-9",]*)\]'
)

# cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``): its
# backend config names the score matrix ``[B, N, T, S]`` and the mask it applies.
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
_FMHA_SCORES = re.compile(
    r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([0-9",\s]*)\]'
)
_FMHA_MASK = re.compile(r'"mask_type":\s*"(\w+)"')


def fused_attention_flops(line: str) -> float | None:
    """Matmul FLOPs of one cuDNN fused-attention call (an HLO instruction line), or None
    if it is not one: the forward computes ``Q K^T`` and ``P V`` (``2 x 2 B N T S H``),
    the backward recomputes ``Q K^T`` and takes four gradients (``5 x 2 B N T S H``);
    a causal mask type halves it (the kernel skips the masked tiles), any other mask (none,
    padding, an additive bias) computes the whole square. ``H`` is the head dimension,
    the last of the call's first result (the output, or ``dQ``)."""
    kind, scores, out = _FMHA.search(line), _FMHA_SCORES.search(line), _DEF.match(line)
    if not (kind and scores and out):
        return None
    b, n, t, s = _ints(scores.group(1).replace('"', "").replace(" ", ""))
    head = _ints(out.group(2))[-1]
    matmuls = 5 if "Backward" in kind.group(1) else 2
    mask = _FMHA_MASK.search(line)
    share = 0.5 if mask and "CAUSAL" in mask.group(1) else 1.0
    return 2.0 * matmuls * b * n * t * s * head * share


def matmul_flops(hlo_text: str) -> float:
    """FLOPs of every matmul of one run of a compiled program, per device: ``2 x output
    elements x contracted size``, times the runs of its computation (a while body counts
    its known trip count, which XLA's ``cost_analysis()`` counts once: a scan over layers
    would be undercounted by the layer count). Elementwise work is left out.

    Matmuls are ``dot`` instructions (XLA:CPU, and those inside XLA:GPU's Triton gemm
    fusions), XLA:GPU's cuBLAS / cuBLASLt gemm custom calls and cuDNN's fused attention
    calls (:func:`fused_attention_flops`)."""
    comps, entry = _computations(hlo_text)
    runs = _executions(comps, entry)
    total = 0.0
    for name, lines in comps.items():
        if not runs.get(name):
            continue
        shapes = {m.group(1): _ints(m.group(2)) for l in lines if (m := _DEF.match(l))}
        for line in lines:
            if (fmha := fused_attention_flops(line)) is not None:
                total += fmha * runs[name]
                continue
            d = _DOT.search(line) or _GEMM.search(line)
            if d and (out := _DEF.match(line)):
                lhs = shapes[d.group(1)]
                contracted = np.prod([lhs[i] for i in _ints(d.group(2).replace('"', ""))])
                total += 2.0 * np.prod(_ints(out.group(2))) * contracted * runs[name]
    return float(total)


_DOT_TYPE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*([a-z][a-z0-9]*)\[[0-9,]*\]\S*\s+dot\(")


def dot_output_dtypes(hlo_text: str) -> Counter:
    """Element type -> how many matmuls of the program produce it (static count: a dot in
    a loop body counts once): ``dot`` instructions and, on XLA:GPU, cuBLAS gemm calls
    (their first result). Tells whether matmuls of a mixed-precision program write
    ``bf16`` or accumulate into ``f32`` outputs."""
    out: Counter = Counter()
    for line in hlo_text.splitlines():
        if m := _DOT_TYPE.match(line):
            out[m.group(1)] += 1
        elif _GEMM.search(line) and (d := _DEF_TYPE.match(line)):
            out[d.group(1)] += 1
    return out


_DEF_TYPE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*\(?([a-z][a-z0-9]*)\[")


def cost_flops(compiled: Any) -> float:
    """XLA's ``cost_analysis()`` FLOPs of a ``jax.stages.Compiled`` (element-wise work
    included, but a while body counted once: see :func:`matmul_flops` for trip counts)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0))
