"""Bad executor input gives one clear line that names the module and the fix.

Every user mistake in layouts, placement, islands, schedule or batch size must raise a
``ValueError`` subclass (``LayoutError``, ``BoundaryError``, ``ScheduleError``) with a
one-line message naming the module and what to change, before any stage program is
compiled. The CLI turns it into ``llava_train: error: ...`` on stderr with exit code 2
and no traceback; the mistakes it checks before building parameters must not compile
anything at all (``JAX_LOG_COMPILES=1`` would print it). The ones only the Executor
detects are reported after the CLI has initialised the parameters (which compiles the
initialisers), so for those only the one-line contract is checked.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import pytest

import hetjax
from hetjax import Layout, LayoutError
from hetjax.boundary import BoundaryError, EdgeSpec, Endpoint
from hetjax.config import InvalidConfigError, module_layouts
from hetjax.inspect import CompileCounter
from hetjax.meshes import place_modules
from hetjax.schedules import ScheduleError
from models.config import get_preset
from models.mllm import MLLM
from tests.launch import TRAIN, run_main

USER_ERRORS = (LayoutError, BoundaryError, ScheduleError, InvalidConfigError)


def layouts(**texts: str) -> dict[str, Layout]:
    return {name: Layout.parse(text, module=name) for name, text in texts.items()}


def check_one_line(excinfo: pytest.ExceptionInfo, *patterns: str) -> str:
    """The error is a user-error ValueError with a one-line message matching ``patterns``."""
    err = excinfo.value
    assert isinstance(err, ValueError) and isinstance(err, USER_ERRORS), type(err)
    msg = str(err)
    assert msg and "\n" not in msg, msg
    for pattern in patterns:
        assert re.search(pattern, msg), (pattern, msg)
    return msg


@pytest.fixture(scope="module")
def model():
    cfg = get_preset("tiny")
    m = MLLM(cfg)
    return m, m.init(jax.random.key(0))


def make(model, lays, **plan):
    """The executor of ``lays``, planned with ``plan`` (:func:`hetjax.plan_run`'s options)."""
    m, params = model
    run = hetjax.plan_run(m.train_graph(lays), num_devices=len(jax.devices()), **plan)
    return hetjax.Executor(run, params, devices=jax.devices())


# -- layouts and placement ------------------------------------------------------------


@pytest.mark.parametrize(
    ("lays", "patterns"),
    [
        (
            layouts(vision="dp=8", llm="dp=3"),
            [r"^llm: ", r"dp\*tp\*cp\*pp = 3\*1\*1\*1 = 3", r"8 devices", r"product is 8"],
        ),
        (
            layouts(vision="dp=2,tp=2", llm="dp=2,tp=2,pp=2"),
            [r"^vision: ", r"= 4 but the module has 8 devices", r"product is 8"],
        ),
    ],
    ids=["llm-3-of-8", "vision-4-of-8"],
)
def test_layout_must_multiply_to_device_count(model, lays, patterns):
    with pytest.raises(LayoutError) as excinfo:
        make(model, lays, mode="colocated")
    check_one_line(excinfo, *patterns)


def test_non_colocated_needs_islands(model):
    with pytest.raises(LayoutError) as excinfo:
        make(model, layouts(vision="dp=4", llm="dp=2,pp=2"), mode="non-colocated")
    check_one_line(excinfo, r"needs an island per module", r"islands=\{'vision': 4, 'llm': 4\}")


def test_islands_must_name_every_module(model):
    lays = layouts(vision="dp=4", llm="dp=2,pp=2")
    with pytest.raises(LayoutError) as excinfo:
        make(model, lays, mode="non-colocated", islands={"vision": 4})
    check_one_line(excinfo, r"missing \['llm'\]")
    with pytest.raises(LayoutError) as excinfo:
        make(model, lays, mode="non-colocated", islands={"vision": 4, "llm": 4, "audio": 1})
    check_one_line(excinfo, r"unknown \['audio'\]")


def test_island_count_must_match_layout(model):
    with pytest.raises(LayoutError) as excinfo:
        make(
            model,
            layouts(vision="dp=4", llm="dp=2,pp=2"),
            mode="non-colocated",
            islands={"vision": 2, "llm": 4},
        )
    check_one_line(
        excinfo, r"^vision: island of 2 devices", r"needs 4", r"make islands=\{'vision': 4\} match"
    )


def test_islands_must_fit_the_devices(model):
    with pytest.raises(LayoutError) as excinfo:
        make(
            model,
            layouts(vision="dp=8", llm="dp=4"),
            mode="non-colocated",
            islands={"vision": 8, "llm": 4},
        )
    check_one_line(excinfo, r"need 12 devices but only 8 exist", r"shrink the islands")


def test_colocated_takes_no_islands(model):
    with pytest.raises(LayoutError) as excinfo:
        make(
            model,
            layouts(vision="dp=8", llm="dp=8"),
            mode="colocated",
            islands={"vision": 8, "llm": 8},
        )
    check_one_line(excinfo, r"drop islands", r"mode='non-colocated'")


def test_offload_needs_colocated(model):
    with pytest.raises(LayoutError) as excinfo:
        make(
            model,
            layouts(vision="dp=4", llm="dp=2,pp=2"),
            mode="non-colocated",
            islands={"vision": 4, "llm": 4},
            offload_encoders=True,
        )
    check_one_line(
        excinfo, r"encoder offload", r"drop offload_encoders=True or use mode='colocated'"
    )


def test_colocated_runs_three_phase_not_gpipe(model):
    with pytest.raises(LayoutError) as excinfo:
        make(model, layouts(vision="dp=8", llm="dp=2,pp=4"), mode="colocated", schedule="gpipe")
    check_one_line(excinfo, r"three-phase", r"schedule='gpipe'", r"non-colocated or homogeneous")


def test_partially_overlapping_modules_are_a_boundary_error():
    devices = jax.devices()
    vision = place_modules({"vision": "dp=4"}, devices[0:4], placement="colocated")["vision"]
    llm = place_modules({"llm": "dp=4"}, devices[2:6], placement="colocated")["llm"]
    with pytest.raises(BoundaryError) as excinfo:
        EdgeSpec(Endpoint.source(vision), Endpoint.destination(llm))
    check_one_line(excinfo, r"vision->llm", r"share 2 of their 4 and 4 devices", r"disjoint")


def test_unknown_module_in_layouts():
    with pytest.raises(InvalidConfigError) as excinfo:
        module_layouts({"nope": "dp=8"}, ["vision", "llm"])
    check_one_line(excinfo, r"parallel.layouts 'nope:dp=8'", r"\['vision', 'llm'\]")


def test_layout_parse_error_names_the_module():
    with pytest.raises(LayoutError) as excinfo:
        module_layouts({"llm": "dp=two"}, ["vision", "llm"])
    check_one_line(excinfo, r"^llm: ", r"dp='two'", r"e\.g\. dp=2")


# -- batch ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fan_out_executor(model):
    """Colocated vision dp=4,tp=2 -> llm dp=8, two microbatches (nothing compiled yet)."""
    return make(model, layouts(vision="dp=4,tp=2", llm="dp=8"), microbatches=2)


@pytest.mark.parametrize(
    ("global_batch", "patterns"),
    [
        (6, [r"^vision: global batch 6", r"dp\*microbatches = 4\*2 = 8", r"multiple of 8"]),
        (8, [r"^llm: global batch 8", r"dp\*microbatches = 8\*2 = 16", r"multiple of 16"]),
        (24, [r"^llm: global batch 24", r"multiple of 16", r"e\.g\. 16 or 32"]),
    ],
)
def test_batch_must_divide_dp_times_microbatches(fan_out_executor, global_batch, patterns):
    with pytest.raises(LayoutError) as excinfo:
        fan_out_executor.validate_batch(global_batch)
    check_one_line(excinfo, *patterns)
    fan_out_executor.validate_batch(32)  # a multiple of every module's dp x microbatches


def test_step_rejects_bad_batch_before_dispatching(fan_out_executor):
    from models.data import SyntheticConfig, SyntheticLlava

    cfg = get_preset("tiny")
    batch = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0)).batch(0, 8)
    with CompileCounter() as compiles, pytest.raises(LayoutError) as excinfo:
        fan_out_executor.step(batch)
    check_one_line(excinfo, r"^llm: global batch 8")
    assert compiles.count == 0, compiles.names  # nothing was compiled, so nothing ran


def test_microbatches_must_be_positive(model):
    with pytest.raises(ValueError, match="microbatches") as excinfo:
        make(model, layouts(vision="dp=8", llm="dp=8"), microbatches=0)
    assert "\n" not in str(excinfo.value)


# -- model shapes against degrees -------------------------------------------------------


def test_pp_must_divide_layers(model):
    m, _ = model
    lays = layouts(vision="dp=8", llm="dp=1,tp=1,pp=8")
    with pytest.raises(LayoutError) as excinfo:
        m.validate_layouts(lays)
    check_one_line(excinfo, r"^llm: layers=4 is not divisible by pp=8", r"use pp in \[1, 2, 4\]")
    with pytest.raises(LayoutError) as excinfo:  # the graph itself refuses it too
        m.train_graph(layouts(vision="dp=8", llm="dp=2,pp=3"))
    check_one_line(excinfo, r"^llm: 4 layers do not split into pp=3", r"pp that divides 4")


@pytest.mark.parametrize(
    ("lays", "patterns"),
    [
        (layouts(vision="tp=8", llm="dp=8"), [r"^vision: heads=4 is not divisible by tp=8"]),
        (layouts(vision="dp=8", llm="dp=2,tp=3"), [r"^llm: heads=8 is not divisible by tp=3"]),
        (layouts(vision="dp=8", llm="tp=8"), [r"^llm: kv_heads=4 is not divisible by tp=8"]),
    ],
    ids=["vision-heads", "llm-heads", "llm-kv-heads"],
)
def test_heads_must_divide_by_tp(model, lays, patterns):
    m, _ = model
    with pytest.raises(LayoutError) as excinfo:
        m.validate_layouts(lays)
    check_one_line(excinfo, *patterns, r"use tp in \[")


@pytest.mark.parametrize(
    ("slots", "pattern"),
    [
        ((("audio", "tokens", 3),), r"^llm: token_slots names link input 'audio'.*\['image'\]"),
        ((("image", "targets", 3),), r"^llm: token_slots reads placeholders from 'targets'"),
    ],
    ids=["unknown-link", "not-a-sequence-input"],
)
def test_token_slots_must_name_a_link_and_a_sequence_input(model, slots, pattern):
    m, _ = model
    graph = m.train_graph(layouts(vision="dp=8", llm="dp=2,cp=4"))
    llm = dataclasses.replace(graph.module("llm"), token_slots=slots, seq_inputs=("tokens",))
    with pytest.raises(LayoutError) as excinfo:
        dataclasses.replace(graph, modules=(graph.module("vision"), llm))
    check_one_line(excinfo, pattern)


def test_encoder_tokens_must_divide_by_cp(model):
    """An encoder with cp > 1 (its own, or inherited in the homogeneous baseline) splits
    its tokens over cp."""
    m, _ = model
    with pytest.raises(LayoutError) as excinfo:
        m.validate_layouts(layouts(vision="dp=2,cp=3", llm="dp=8"))
    check_one_line(excinfo, r"^vision: seq=16 is not divisible by cp=3", r"use cp in \[")


# -- the CLI ---------------------------------------------------------------------------

# name -> (flags, patterns of the one error line, whether the CLI catches it before
# building parameters - then nothing may be compiled, which JAX_LOG_COMPILES=1 would show)
CLI_CASES = {
    "unknown-module": (
        ["--layout", "nope:dp=8"],
        [r"--layout 'nope:dp=8'", r"MODULE one of \['vision', 'llm'\]"],
        True,
    ),
    "llm-dp3": (["--layout", "llm:dp=3"], [r"dp\*\S+ = 3\*", r"multiple of|product is"], True),
    "llm-dp3-devices": (
        ["--layout", "vision:dp=8", "--layout", "llm:dp=3", "--microbatches", "1",
         "--global-batch", "24"],
        [r"^llava_train: error: llm: dp\*tp\*cp\*pp = 3\*1\*1\*1 = 3", r"product is 8"],
        False,
    ),
    "no-llm-layout": (
        ["--layout", "vision:dp=8"],
        [r"give the LLM's layout too", r"--layout llm:"],
        True,
    ),
    "island-with-colocated": (
        ["--island", "vision:4"],
        [r"--island is only for --placement non-colocated"],
        True,
    ),
    "heads-vs-tp": (
        ["--layout", "vision:tp=8", "--layout", "llm:dp=8"],
        [r"vision: heads=4 is not divisible by tp=8"],
        True,
    ),
    "non-colocated-without-island": (
        ["--layout", "vision:dp=4", "--layout", "llm:dp=2,pp=2", "--placement", "non-colocated"],
        [r"needs an island per module", r"--island vision:4 --island llm:4"],
        False,
    ),
    "island-not-a-count": (
        ["--layout", "vision:dp=4", "--layout", "llm:dp=2,pp=2", "--placement", "non-colocated",
         "--island", "vision:x", "--island", "llm:4"],
        [r"--island 'vision:x'", r"MODULE:N"],
        False,
    ),
    "gpipe-colocated": (
        ["--schedule", "gpipe"],
        [r"three-phase", r"--schedule gpipe is only for non-colocated or homogeneous"],
        False,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def cli_runs():
    """All CLI error cases, run in the test process (:func:`tests.launch.run_main`) one
    after the other; a real process's exit 2 is checked in tests/test_llava_train_cli.py."""
    runs = {
        name: run_main(TRAIN, "--steps", "2", *flags, log_compiles=early)
        for name, (flags, _, early) in CLI_CASES.items()
    }
    return {name: (r.returncode, r.stdout, r.stderr) for name, r in runs.items()}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_bad_layout_is_one_line(cli_runs, name):
    _, patterns, early = CLI_CASES[name]
    code, stdout, stderr = cli_runs[name]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert code == 2, stderr[-3000:]
    # Abstract shapes may be traced (logged as "Finished tracing"); a compilation would
    # be logged as "Compiling ..." and make a second line.
    lines = [l for l in stderr.splitlines() if not l.startswith("Finished tracing")]
    assert len(lines) == 1, stderr[-3000:]
    (line,) = lines
    assert line.startswith("llava_train: error: "), line
    for pattern in patterns:
        assert re.search(pattern, line), (pattern, line)
    assert "hetjax run summary" not in stdout
    if early:
        assert not re.search(r"[Cc]ompil", stderr)
