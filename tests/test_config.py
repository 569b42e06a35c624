"""The config tree, its files and the CLI's flag table, in-process (nothing trains).

A run's settings are parsed once at the edge and checked once: these tests pin that the
tree survives plain data and files unchanged (island order included), that a bad key or
value is one line naming it, that flags override a ``--config`` file and
``--print-config`` reads back equal, and that core errors come out in flag names.
"""

from __future__ import annotations

import json
import re

import pytest

import hetjax
import hetjax.config as hc
import hetjax.train
from experiments import flags
from models.config import get_preset
from models.mllm import MLLM
from tests.launch import ROOT

EXAMPLE = ROOT / "experiments" / "configs" / "tiny_noncolocated.yaml"
README = ROOT / "README.md"

NON_DEFAULT = {
    "steps": 7,
    "seed": 3,
    "model": {"preset": "tiny-av", "seq_len": 96, "dtype": "bfloat16"},
    "data": {"global_batch": 16},
    "parallel": {
        "layouts": {"llm": "dp=2,tp=2", "vision": "dp=2", "audio": "dp=2"},
        "placement": "non-colocated",
        "islands": {"llm": 4, "vision": 2, "audio": 2},  # not sorted: order places them
        "schedule": "gpipe",
        "microbatches": 2,
        "devices": 8,
    },
    "optimizer": {"lr": 1e-5, "warmup_steps": 0, "weight_decay": 0.0, "clip_norm": -1.0},
    "distributed": {"coordinator": "host:1234", "num_processes": 2, "process_id": 1},
    "logging": {
        "metrics": "out dir/m: #1.jsonl",
        "timeline": "t.png",
        "tensorboard": "tb",
        "profile_steps": "0:1",
        "profile_dir": "prof",
        "plot": "p.png",
    },
}


def parse(*argv: str) -> hc.TrainConfig:
    return flags.parse_args(argv, prog="llava_train")


def one_line(excinfo, *patterns: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    return message


# -- the tree and plain data ------------------------------------------------------------


@pytest.mark.parametrize("data", [{}, NON_DEFAULT], ids=["defaults", "non-default"])
def test_dict_round_trip_keeps_values_and_island_order(data):
    cfg = hc.from_dict(data)
    again = hc.from_dict(hc.to_dict(cfg))
    assert again == cfg
    assert list(again.parallel.islands) == list(cfg.parallel.islands)
    assert json.loads(json.dumps(hc.to_dict(cfg))) == hc.to_dict(cfg)  # plain data only


def test_from_dict_fills_defaults_and_converts_what_files_cannot_say():
    cfg = hc.from_dict({"parallel": {"layouts": ["llm:dp=2,tp=2"]}, "optimizer": {"lr": 1}})
    assert cfg.parallel.layouts == {"llm": "dp=2,tp=2"}
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.steps == hc.TrainConfig().steps and cfg.model == hc.ModelConfig()


def test_every_field_has_a_one_line_doc():
    for path, leaf in hc.leaves().items():
        assert leaf.doc and "\n" not in leaf.doc, path


def test_the_tree_is_frozen():
    with pytest.raises(AttributeError):
        hc.TrainConfig().steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("data", "patterns"),
    [
        (
            {"stepz": 3},
            [r"unknown config key 'stepz'", r"valid keys: 'steps', 'stop_after', "],
        ),
        (
            {"parallel": {"layout": {}}},
            [r"unknown config key 'parallel.layout'", r"valid keys of parallel: 'layouts'"],
        ),
        ({"parallel": 4}, [r"^parallel must be a mapping"]),
        ({"steps": "10"}, [r"^steps='10' is not an integer"]),
        ({"steps": True}, [r"^steps=True is not an integer"]),
        ({"optimizer": {"lr": "fast"}}, [r"optimizer.lr='fast' is not a number"]),
        ({"model": {"dtype": "fp8"}}, [r"model.dtype='fp8' is not one of 'float32'"]),
        ({"parallel": {"islands": {"llm": "4"}}}, [r"parallel.islands=\{'llm': '4'\} is not"]),
        ({"parallel": {"islands": ["llm=4"]}}, [r"parallel.islands 'llm=4': expected MODULE:N"]),
        ({"parallel": {"layouts": ["a:x", "a:y"]}}, [r"names 'a' twice"]),
        ({"steps": 0}, [r"^steps=0 must be a positive integer"]),
        ({"seed": -1}, [r"^seed=-1 must be a non-negative integer"]),
        ({"parallel": {"microbatches": 0}}, [r"parallel.microbatches=0 must be a positive"]),
        ({"parallel": {"islands": {"llm": 0}, "placement": "non-colocated"}}, [r"positive"]),
        ({"parallel": {"islands": {"llm": 4}}}, [r"islands is only for .*'non-colocated'"]),
        (
            {"parallel": {"homogeneous": True, "placement": "non-colocated"}},
            [r"parallel.homogeneous", r"drop one"],
        ),
        (
            {"parallel": {"reference": True}, "logging": {"timeline": "t.png"}},
            [r"^logging.timeline is a heterogeneous-executor option; drop parallel.reference"],
        ),
    ],
)
def test_bad_key_or_value_is_one_line(data, patterns):
    with pytest.raises(hc.InvalidConfigError) as excinfo:
        hc.from_dict(data)
    one_line(excinfo, *patterns)


# -- files ----------------------------------------------------------------------------


def test_load_reads_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("steps: 5\noptimizer:\n  lr: 1e-5  # YAML 1.2 float\n")
    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps(NON_DEFAULT))
    cfg = hc.load(yaml_file)
    assert cfg.steps == 5 and cfg.optimizer.lr == 1e-5
    assert hc.load(json_file) == hc.from_dict(NON_DEFAULT)
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    assert hc.load(tmp_path / "empty.yaml") == hc.TrainConfig()


@pytest.mark.parametrize(
    ("name", "text", "patterns"),
    [
        ("bad.yaml", "steps: [1\n", [r"'.*bad.yaml': invalid YAML at line \d+"]),
        ("bad.json", "{steps: 1}", [r"'.*bad.json': invalid JSON"]),
        ("list.yaml", "- 1\n", [r"must be a mapping"]),
        ("key.yaml", "parallel:\n  islandz: {}\n", [r"unknown config key 'parallel.islandz'"]),
    ],
)
def test_bad_file_is_one_line(tmp_path, name, text, patterns):
    (tmp_path / name).write_text(text)
    with pytest.raises(hc.InvalidConfigError) as excinfo:
        hc.load(tmp_path / name)
    one_line(excinfo, *patterns)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(hc.InvalidConfigError) as excinfo:
        hc.load(tmp_path / "nope.yaml")
    one_line(excinfo, r"nope.yaml", r"No such file")


def test_dump_reads_back_equal_and_documents_every_field(tmp_path):
    cfg = hc.from_dict(NON_DEFAULT)
    text = hc.dump(cfg)
    (tmp_path / "run.yaml").write_text(text)
    again = hc.load(tmp_path / "run.yaml")
    assert again == cfg and list(again.parallel.islands) == ["llm", "vision", "audio"]
    for path in hc.leaves():
        (line,) = [l for l in text.splitlines() if l.strip().startswith(path.split(".")[-1] + ":")]
        assert "  # " in line, line


# -- the CLI's flag table -------------------------------------------------------------


def test_every_readme_flag_is_in_the_table_and_every_setting_has_a_flag():
    section = README.read_text().split("## `python -m experiments.llava_train`", 1)[1]
    rows = [l for l in section.strip().split("\n\n")[0].splitlines() if l.startswith("| `--")]
    readme_flags = {f for row in rows for f in re.findall(r"`(--[a-z0-9-]+)", row.split("|")[1])}
    table = {f.name for f in flags.FLAGS}
    assert readme_flags == table
    paths = {f.path for f in flags.FLAGS}
    assert set(hc.leaves()) == paths


def test_flags_set_their_paths():
    cfg = parse(
        *("--model", "tiny-av", "--steps", "9", "--global-batch", "16", "--seed", "4"),
        *("--layout", "vision:dp=4", "--layout", "llm:dp=2,tp=2", "--placement", "non-colocated"),
        *("--island", "vision:4", "--island", "llm:4", "--schedule", "gpipe", "--zero1"),
        *("--lr", "0.01", "--devices", "8", "--metrics", "m.jsonl"),
    )
    assert (cfg.model.preset, cfg.steps, cfg.data.global_batch, cfg.seed) == ("tiny-av", 9, 16, 4)
    assert cfg.parallel.layouts == {"vision": "dp=4", "llm": "dp=2,tp=2"}
    assert list(cfg.parallel.islands.items()) == [("vision", 4), ("llm", 4)]
    assert cfg.parallel.schedule == "gpipe" and cfg.parallel.zero1 and cfg.parallel.devices == 8
    assert cfg.optimizer.lr == 0.01 and cfg.logging.metrics == "m.jsonl"
    assert parse() == hc.TrainConfig()


def test_flags_override_only_what_they_give_on_top_of_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(hc.dump(hc.from_dict(NON_DEFAULT | {"parallel": {"zero1": True}})))
    base = hc.load(path)
    assert parse("--config", str(path)) == base
    cfg = parse("--config", str(path), "--steps", "2", "--no-zero1", "--layout", "llm:dp=4")
    assert cfg.steps == 2 and not cfg.parallel.zero1
    assert cfg.parallel.layouts == {"llm": "dp=4"}  # a repeated flag replaces the mapping
    assert cfg.model == base.model and cfg.optimizer == base.optimizer
    assert cfg.parallel.islands == base.parallel.islands


def test_print_config_reads_back_equal(tmp_path, capsys):
    argv = ("--placement", "non-colocated", "--island", "vision:4", "--island", "llm:4")
    argv += ("--lr", "1e-5", "--seed", "2", "--metrics", str(tmp_path / "m.jsonl"))
    with pytest.raises(SystemExit) as excinfo:
        parse(*argv, "--print-config")
    assert excinfo.value.code == 0
    (tmp_path / "run.yaml").write_text(capsys.readouterr().out)
    assert parse("--config", str(tmp_path / "run.yaml")) == parse(*argv)


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--steps", "0"], r"^argument --steps: expected a positive integer, got 0"),
        (["--island", "vision:4"], r"^--island is only for --placement non-colocated"),
        (["--seed", "-1"], r"^--seed -1 must be a non-negative integer"),
        (["--reference", "--zero1"], r"^--zero1 is a heterogeneous-executor option; drop --ref"),
        (
            ["--placement", "non-colocated", "--island", "v:x"],
            r"^--island 'v:x': expected MODULE:N",
        ),
        (["--config", "/nonexistent/run.yaml"], r"config file '/nonexistent/run.yaml'"),
        (
            ["--profile-steps", "3:2", "--profile-dir", "d"],
            r"^--profile-steps 3:2 starts after it ends; give A <= B, e\.g\. --profile-steps 2:3",
        ),
        (
            ["--steps", "5", "--profile-steps", "3:7", "--profile-dir", "d"],
            r"^--profile-steps 3:7 is outside the run \(metrics steps 0\.\.4\); .* 3:4$",
        ),
        (
            ["--steps", "5", "--stop-after", "3", "--profile-steps", "2:3", "--profile-dir", "d"],
            r"^--profile-steps 2:3 is outside the run \(metrics steps 0\.\.2\)",
        ),
        (["--profile-steps", "two", "--profile-dir", "d"], r"^--profile-steps two is not A:B"),
        (["--profile-steps", "2:3"], r"^--profile-steps needs --profile-dir; give both"),
        (["--profile-dir", "d"], r"^--profile-dir needs --profile-steps; give both"),
        (["--plot", "run.jpg"], r"^--plot run\.jpg must be a \.png path"),
    ],
)
def test_bad_flags_are_one_line_in_flag_names(argv, pattern):
    from experiments.cli import ConfigError

    with pytest.raises(ConfigError) as excinfo:
        parse(*argv)
    one_line(excinfo, pattern)


@pytest.mark.parametrize(
    ("core", "cli"),
    [
        (
            "needs an island per module, e.g. islands={'vision': 4, 'llm': 4} for these",
            "needs an island per module, e.g. --island vision:4 --island llm:4 for these",
        ),
        ("schedule='gpipe' is only for", "--schedule gpipe is only for"),
        ("use mode='non-colocated'", "use --placement non-colocated"),
        ("or mode='colocated'", "or --placement colocated"),
        ("not mode='homogeneous'", "not --homogeneous"),
        ("drop offload_encoders=True or", "drop --offload-encoder or"),
        ("or use num_devices=16", "or use --devices 16"),
        ("microbatches=3 must", "--microbatches 3 must"),
        ("drop islands or", "drop --island or"),
        ("make islands={'llm': 4} match", "make --island llm:4 match"),
        ("layouts={'llm': 'dp=2,tp=2,pp=2'}", "--layout llm:dp=2,tp=2,pp=2"),
        ("parallel.layouts 'nope:dp=8': expected", "--layout 'nope:dp=8': expected"),
        ("parallel.zero1 is", "--zero1 is"),
        ("seed=-1 must", "--seed -1 must"),
        ("optimizer.lr=0.0 must", "--lr 0.0 must"),
        # Left alone: plain words, degrees, quoted names, flags already.
        ("the three-phase schedule (its LLM phase)", "the three-phase schedule (its LLM phase)"),
        ("dp*microbatches = 4*2 = 8", "dp*microbatches = 4*2 = 8"),
        ("llm: dp=2 in layout 'dp=2'", "llm: dp=2 in layout 'dp=2'"),
        ("--island vision:4 --placement colocated", "--island vision:4 --placement colocated"),
        ("valid keys: 'steps', 'islands'", "valid keys: 'steps', 'islands'"),
    ],
)
def test_core_errors_translate_into_flags(core, cli):
    assert flags.as_flags(core) == cli


def test_module_layouts_checks_module_names_and_parses_layouts():
    layouts = hc.module_layouts({"vision": "dp=8", "llm": "dp=2,tp=2"}, ["vision", "llm"])
    assert layouts == {"vision": hetjax.Layout(dp=8), "llm": hetjax.Layout(dp=2, tp=2)}
    with pytest.raises(hc.InvalidConfigError) as excinfo:
        hc.module_layouts({"nope": "dp=8"}, ["vision", "llm"])
    one_line(excinfo, r"^parallel.layouts 'nope:dp=8'", r"MODULE one of \['vision', 'llm'\]")
    with pytest.raises(hetjax.LayoutError) as excinfo:
        hc.module_layouts({"llm": "dp=two"}, ["vision", "llm"])
    one_line(excinfo, r"^llm: ", r"dp='two'", r"e\.g\. dp=2")


# -- defaults and the README example ----------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "tiny-av"])
@pytest.mark.parametrize("mode", ["colocated", "non-colocated", "homogeneous"])
def test_default_layouts_plan_on_8_devices(preset, mode):
    """Colocated defaults are unchanged; non-colocated ones fit islands into the devices,
    so the islands the plan's error suggests are ones that run."""
    model = MLLM(get_preset(preset))
    names = model.module_names
    layouts = hetjax.train.default_layouts(names, 8, mode)
    if mode != "non-colocated":
        want = {n: ("dp=2,tp=2,pp=2" if n == "llm" else "dp=8") for n in names}
        assert layouts == hc.module_layouts(want, names)
    graph = model.train_graph(layouts)
    islands = {n: l.num_devices for n, l in layouts.items()} if mode == "non-colocated" else None
    plan = hetjax.runtime.plan_run(
        graph, num_devices=8, mode=mode, islands=islands, microbatches=4, global_batch=32
    )
    if mode == "non-colocated":
        assert sum(islands.values()) <= 8 and layouts["llm"] == hetjax.Layout(tp=2, pp=2)
        used = sorted(p for positions in plan.positions.values() for p in positions)
        assert used == sorted(set(used))  # disjoint islands


def test_non_colocated_without_islands_suggests_islands_that_fit():
    model = MLLM(get_preset("tiny"))
    layouts = hetjax.train.default_layouts(model.module_names, 8, "non-colocated")
    with pytest.raises(ValueError) as excinfo:
        hetjax.runtime.plan_run(model.train_graph(layouts), num_devices=8, mode="non-colocated")
    message = flags.as_flags(str(excinfo.value))
    assert "--island vision:4 --island llm:4" in message, message


def test_readme_example_config_is_the_committed_file_and_plans():
    text = README.read_text()
    block = re.search(r"```yaml\n(.*?)```", text.split("### The config tree", 1)[1], re.S)
    assert block.group(1) == EXAMPLE.read_text()
    cfg = flags.parse_args(["--config", str(EXAMPLE)], prog="llava_train")
    assert cfg == hc.load(EXAMPLE)
    p = cfg.parallel
    model = MLLM(get_preset(cfg.model.preset))
    layouts = hc.module_layouts(p.layouts, model.module_names)
    model.validate_layouts(layouts, seq_len=cfg.model.seq_len)
    hetjax.runtime.plan_run(
        model.train_graph(layouts),
        num_devices=8,
        mode=p.mode,
        islands=p.islands,
        microbatches=p.microbatches,
        schedule=p.schedule,
        global_batch=cfg.data.global_batch,
    )
    # The README's tree lists every section and field.
    tree = re.search(r"```text\n(.*?)```", text.split("### The config tree", 1)[1], re.S)
    listed = set(re.findall(r"[a-z_0-9]+", tree.group(1).replace("TrainConfig", "")))
    assert {p.split(".")[-1] for p in hc.leaves()} | set(hc.io.sections()) == listed
