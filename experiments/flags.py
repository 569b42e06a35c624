"""The training CLI's flags: ONE table mapping each flag onto a path of the config tree.

``python -m experiments.llava_train`` resolves its settings here, once: the defaults of
:class:`hetjax.config.TrainConfig`, then the file of ``--config FILE`` (YAML or JSON),
then every flag actually given (a repeatable flag given replaces the whole setting, e.g.
all of ``parallel.layouts``). ``--print-config`` writes the result as YAML that
``--config`` reads back to the same config, and exits.

Why a hand-kept table and not tyro or draccus (both generate a CLI from dataclasses):
they name a nested field by its path (``--parallel.microbatches``,
``--optimizer.lr``), so every flag of today's README would be renamed, and neither
spells a mapping as the repeatable ``--layout MODULE:LAYOUT`` / ``--island MODULE:N``
items users type. The table keeps every flag's name and meaning, takes its help and
default from the field's doc, and is also what turns core errors back into flag names
(:func:`as_flags`), so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, get_args, get_origin

import hetjax.config as hc
from experiments.cli import (
    ConfigError,
    OneLineParser,
    non_negative_int,
    positive_float,
    positive_int,
)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One CLI flag and the config setting it sets."""

    name: str  # e.g. "--global-batch"
    path: str  # dotted config path, e.g. "data.global_batch"
    parse: Callable[[str], Any] | None = None  # value parser; None: from the field's type
    help: str = ""  # "": the field's doc
    metavar: str | None = None
    core: tuple[str, ...] = ()  # core parameter names for the same setting (errors)
    render: Callable[[Any], str] | None = None  # value -> flags, where not `name value`
    repeat: bool = False  # a comma-separated text given once per item (--rebalance vision)


def _placement(mode: str) -> str:
    return "--homogeneous" if mode == "homogeneous" else f"--placement {mode}"


FLAGS: tuple[Flag, ...] = (
    Flag("--model", "model.preset", str, metavar="PRESET"),
    Flag("--init-from", "model.init_from", str, metavar="DIR"),
    Flag(
        "--init",
        "model.init",
        metavar="MODULE=DIR",
        help="start a module from a Hugging Face checkpoint: vision=CLIP_OR_SIGLIP_DIR, "
        "llm=LLAMA_DIR (repeatable; the projector and the rest start fresh)",
    ),
    Flag("--steps", "steps", positive_int),
    Flag("--stop-after", "stop_after", positive_int, metavar="N"),
    Flag("--skip-nonfinite-steps", "skip_nonfinite_steps", non_negative_int, metavar="N"),
    Flag("--global-batch", "data.global_batch", positive_int),
    Flag("--microbatches", "parallel.microbatches", positive_int, core=("microbatches",)),
    Flag("--seq-len", "model.seq_len", positive_int),
    Flag("--vocab-size", "model.vocab_size", positive_int),
    Flag(
        "--data",
        "data.sources",
        metavar="FILE[:WEIGHT]",
        help="LLaVA JSON list or JSONL file, with its mixture weight (repeatable, e.g. "
        "--data a.json:0.7 --data b.jsonl:0.3; none: synthetic data)",
    ),
    Flag("--image-folder", "data.image_folder", str, metavar="DIR"),
    Flag("--tokenizer", "data.tokenizer", str, metavar="PATH"),
    Flag("--template", "data.template"),
    Flag("--image-aspect", "data.image_aspect"),
    Flag("--max-images-per-microbatch", "data.max_images_per_microbatch", positive_int),
    Flag("--max-loss-tokens-per-microbatch", "data.max_loss_tokens_per_microbatch", positive_int),
    Flag("--max-samples-per-row", "data.max_samples_per_row", positive_int),
    Flag("--max-patches-per-microbatch", "data.max_patches_per_microbatch", positive_int),
    Flag("--min-pixels", "data.min_pixels", positive_int),
    Flag("--max-pixels", "data.max_pixels", positive_int),
    Flag("--video-fps", "data.video_fps", positive_float),
    Flag("--max-frames", "data.max_frames", positive_int),
    Flag("--pack", "data.pack"),
    Flag("--balance", "data.balance"),
    Flag("--synthetic-max-images", "data.synthetic_max_images", positive_int, metavar="N"),
    Flag("--skip-bad-samples", "data.skip_bad_samples"),
    Flag("--loader-workers", "data.workers", positive_int, metavar="N"),
    Flag("--prefetch", "data.prefetch", positive_int, metavar="N"),
    Flag("--dtype", "model.dtype"),
    Flag(
        "--freeze",
        "model.freeze",
        str,
        metavar="PART[,PART]",
        help="modules or parts not trained: vision (the encoder alone), projector, llm, audio, "
        "audio_projector; LLaVA stage 1 is vision,llm, stage 2 vision",
    ),
    Flag("--seed", "seed", int),
    Flag("--lr", "optimizer.lr", positive_float),
    Flag("--warmup-steps", "optimizer.warmup_steps", int),
    Flag("--weight-decay", "optimizer.weight_decay", float),
    Flag("--clip-norm", "optimizer.clip_norm", float),
    Flag("--devices", "parallel.devices", positive_int, core=("num_devices",)),
    Flag("--peak-tflops", "parallel.peak_tflops", positive_float, metavar="TFLOPS"),
    Flag("--metrics", "logging.metrics", str, metavar="PATH.jsonl"),
    Flag(
        "--layout",
        "parallel.layouts",
        metavar="MODULE:LAYOUT",
        help="a module's degrees (dp, fsdp, tp, cp, pp, ep), e.g. vision:dp=8 or "
        "llm:dp=2,tp=2,pp=2 or llm:fsdp=4,tp=2 (repeatable; a module without one gets the "
        "LLM's); auto: the planner chooses layouts and placement",
    ),
    Flag("--placement", "parallel.placement", core=("mode",), render=_placement),
    Flag(
        "--island",
        "parallel.islands",
        metavar="MODULE:N",
        help="device count of a module's island, assigned in order (repeatable; non-colocated)",
    ),
    Flag("--homogeneous", "parallel.homogeneous"),
    Flag("--schedule", "parallel.schedule", core=("schedule",)),
    Flag("--offload-encoder", "parallel.offload_encoder", core=("offload_encoders",)),
    Flag(
        "--rebalance",
        "parallel.rebalance",
        str,
        metavar="MODULE",
        help="deal an encoder's images evenly over its dp ranks each step, its outputs back "
        "to the LLM's sample order by an all-to-all (repeatable), e.g. --rebalance vision",
        repeat=True,
    ),
    Flag("--timeline", "logging.timeline", str, metavar="PATH.png"),
    Flag("--tensorboard", "logging.tensorboard", str, metavar="DIR"),
    Flag("--profile-steps", "logging.profile_steps", str, metavar="A:B"),
    Flag("--profile-dir", "logging.profile_dir", str, metavar="DIR"),
    Flag("--plot", "logging.plot", str, metavar="PATH.png"),
    Flag("--checkpoint-dir", "checkpoint.dir", str, metavar="DIR"),
    Flag("--save-every", "checkpoint.save_every", positive_int, metavar="N"),
    Flag("--keep", "checkpoint.keep", positive_int, metavar="K"),
    Flag("--reference", "parallel.reference"),
    Flag(
        "--recompute",
        "parallel.recompute",
        metavar="[MODULE:]POLICY",
        help="activation policy: none (keep the backward's residuals), selective (keep "
        "matmul outputs, recompute the rest) or full (replay each stage's forward); "
        "MODULE:POLICY for one module, a bare POLICY for the others (repeatable; default "
        "none: no forward runs twice)",
    ),
    Flag("--zero1", "parallel.zero1"),
    Flag("--sequence-parallel", "parallel.sequence_parallel"),
    Flag(
        "--coordinator",
        "distributed.coordinator",
        str,
        metavar="HOST:PORT",
        help="multi-process job started by hand: process 0's address (with "
        "--num-processes, --process-id; not needed under python -m hetjax.launch or SLURM)",
    ),
    Flag("--num-processes", "distributed.num_processes", positive_int, metavar="N"),
    Flag("--process-id", "distributed.process_id", non_negative_int, metavar="I"),
)
_LEAVES = hc.leaves()


def build_parser(prog: str, description: str) -> OneLineParser:
    """The argparse parser of :data:`FLAGS` plus ``--config`` and ``--print-config``.

    Every flag defaults to "not given" (``argparse.SUPPRESS``), so only the flags on the
    command line override the file; the help shows the config's default.
    """
    p = OneLineParser(prog=prog, description=description)
    p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON config file (e.g. from --print-config); flags given override it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (what --config reads) and exit",
    )
    for flag in FLAGS:
        leaf = _LEAVES[flag.path]
        kind = dict(dest=flag.path, default=argparse.SUPPRESS, help=_help(flag, leaf))
        metavar = flag.metavar or flag.name[2:].upper().replace("-", "_")
        if leaf.hint is bool:
            p.add_argument(flag.name, action=argparse.BooleanOptionalAction, **kind)
        elif get_origin(leaf.hint) is dict or flag.repeat:
            p.add_argument(flag.name, action="append", metavar=metavar, **kind)
        elif get_origin(leaf.hint) is Literal:
            p.add_argument(flag.name, choices=get_args(leaf.hint), **kind)
        else:
            p.add_argument(flag.name, type=flag.parse, metavar=metavar, **kind)
    return p


def parse_args(argv: Sequence[str], *, prog: str, description: str = "") -> hc.TrainConfig:
    """The resolved, checked config of a command line.

    With ``--print-config`` it prints the config (YAML) and exits 0, as ``--help`` does.

    Raises:
        ConfigError: a bad flag, file or value, in one line naming the flag.
    """
    with errors_as_flags():
        args = vars(build_parser(prog, description).parse_args(list(argv)))
        printing, path = args.pop("print_config"), args.pop("config")
        config = resolve(path, args)
    if printing:
        sys.stdout.write(hc.dump(config))
        raise SystemExit(0)
    return config


def resolve(path: str | None, given: Mapping[str, Any]) -> hc.TrainConfig:
    """The config file at ``path`` (if any) with ``given`` (config path -> flag value, only
    the flags on the command line) on top, checked once."""
    data = hc.read(path) if path else {}
    for dotted, value in given.items():
        if dotted == "parallel.layouts" and list(value) == ["auto"]:
            value = {"auto": "auto"}  # --layout auto: the planner picks (llava_train)
        elif dotted == "parallel.recompute":  # a bare POLICY: every module not named
            value = [v if ":" in v else f"*:{v}" for v in value]
            value = hc.parse_module_items(value, path=dotted)
        elif _LEAVES[dotted].hint is str and isinstance(value, list):  # a repeated flag
            value = ",".join(value)
        elif get_origin(_LEAVES[dotted].hint) is dict:
            kind = get_args(_LEAVES[dotted].hint)[1]
            value = (
                hc.parse_weighted(value, path=dotted)
                if kind is float
                else hc.parse_module_items(value, path=dotted, counts=kind is int)
            )
        *sections, name = dotted.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise hc.InvalidConfigError(f"{section} must be a mapping, got {node!r}")
        node[name] = value
    return hc.from_dict(data)


# name=<python literal> inside a core message: a dict/list without nesting, a quoted
# string, a number, True/False/None.
_LITERAL = r"\{[^{}]*\}|\[[^\[\]]*\]|'[^']*'|\"[^\"]*\"|-?\d+(?:\.\d+)?(?:e-?\d+)?|True|False|None"
# Bare parameter names (no `=value`) that never occur as plain English in a message:
# these, and dotted config paths, are translated on their own.
_BARE = {
    *("islands", "offload_encoders", "num_devices", "coordinator", "num_processes"),
    *("process_id", "freeze", "recompute", "rebalance"),
}


def _by_name() -> dict[str, Flag]:
    """Every name a message may use for a flag's setting -> the flag."""
    out: dict[str, Flag] = {}
    for flag in FLAGS:
        for name in (flag.path, flag.path.rsplit(".", 1)[-1], *flag.core):
            assert out.get(name, flag) is flag, f"{name} names two flags"
            out[name] = flag
    return out


_FLAG_OF = _by_name()
_NAMES = re.compile(
    r"(?<![\w.'\"-])("
    + "|".join(sorted(map(re.escape, _FLAG_OF), key=len, reverse=True))
    + rf")(?!\w)(?:=({_LITERAL}))?"
)


def as_flags(message: str) -> str:
    """A core or config error in this CLI's terms: ``name=<literal>`` parameters and
    dotted config paths become the flags that set them.

    Example: ``"islands={'vision': 4, 'llm': 4}"`` -> ``"--island vision:4 --island
    llm:4"``; ``"schedule='gpipe'"`` -> ``"--schedule gpipe"``; ``"mode='homogeneous'"``
    -> ``"--homogeneous"``; ``"offload_encoders=True"`` -> ``"--offload-encoder"``;
    ``"num_devices=16"`` -> ``"--devices 16"``; a bare ``islands`` -> ``"--island"``.
    """

    def flags(match: re.Match) -> str:
        name, literal = match.group(1), match.group(2)
        flag = _FLAG_OF[name]
        if literal is None:
            return flag.name if ("." in name or name in _BARE) else match.group(0)
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            return match.group(0)
        if flag.render is not None:
            return flag.render(value)
        if isinstance(value, bool):
            return flag.name if value else f"--no-{flag.name[2:]}"
        if isinstance(value, Mapping):
            return " ".join(f"{flag.name} {k}:{v}" for k, v in value.items())
        if isinstance(value, list | tuple):
            return " ".join(f"{flag.name} {v}" for v in value)
        return f"{flag.name} {value}"

    return _NAMES.sub(flags, message)


@contextlib.contextmanager
def errors_as_flags() -> Iterator[None]:
    """Any ``ValueError`` inside (config, layout, boundary, schedule errors) leaves as a
    :class:`~experiments.cli.ConfigError` whose message names flags (:func:`as_flags`)."""
    try:
        yield
    except ValueError as e:
        raise ConfigError(as_flags(str(e))) from None


def _help(flag: Flag, leaf: hc.Leaf) -> str:
    text = flag.help or leaf.doc
    if leaf.default is not None and leaf.default is not False and leaf.default != {}:
        text += f" (default: {leaf.default})"
    return text.replace("%", "%%")
