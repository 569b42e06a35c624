"""Test set-up: 8 simulated CPU devices, configured before JAX starts its backend; the
fixtures tests in several folders share."""

import os
from pathlib import Path

import pytest

from tests._xla import subprocess_flags
from tests.launch import ROOT

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Most of the suite's time is XLA compiling the same stage programs again: in different
# tests (every Executor jits its own closures) and in the subprocesses the CLI and
# multi-process tests start. A persistent compilation cache shared by all of them (they
# inherit the environment) turns every repeat into a load. It lives beside pytest's own
# cache, so a fresh clone starts empty; the key covers the program, the compile options
# and the device assignment, so a hit is the very executable a compile would give.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# 8 simulated devices and patient collectives (see tests/_xla.py);
# subprocesses inherit them.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 "
    + subprocess_flags()
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory):
    """The paths of a small LLaVA-format data set (records, images, tokenizer), made once."""
    from models.llava import demo  # only where a test asks for the data

    out = tmp_path_factory.mktemp("llava")
    return demo.make(str(out), train=96, heldout=16, long_captions=True)


@pytest.fixture(scope="session")
def tok(llava_dir):
    """The BPE tokenizer trained for :func:`llava_dir`."""
    from models.llava import HFTokenizer

    return HFTokenizer(llava_dir["tokenizer"])


# The files that take longest (their module fixtures train several runs), heaviest first.
# pytest-xdist hands whole files to its two workers in collection order, so putting these
# first lets the many short files fill in at the end: otherwise a long file drawn last
# keeps one worker busy while the other idles (``--durations`` on the 2-core machine).
HEAVY_FIRST = (
    "distributed/test_train_multiprocess.py",
    "checkpoint/test_checkpoint.py",
    "checkpoint/test_cli.py",
    "runtime/test_executor_parity.py",
    "runtime/test_parallelism_parity.py",
    "runtime/test_bench_engine.py",
    "runtime/test_bench_executor.py",
    "runtime/test_encoder_matters.py",
    "runtime/test_recompute.py",
    "runtime/test_parallelism_programs.py",
    "runtime/test_freeze.py",
    "plan/test_validation.py",
    "runtime/test_llava_packing.py",
    "test_gpu_check.py",
    "runtime/test_bench_comm.py",
    "test_llava_train_cli.py",
    "models/test_qwen_train.py",
    "runtime/test_bench_checkpoint.py",
    "distributed/test_own_compiles.py",
    "distributed/test_observers.py",
)


def pytest_collection_modifyitems(config, items):
    """Runs the files of :data:`HEAVY_FIRST` first, in that order (a stable sort: the
    other files, and every file's tests, keep their order)."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    tests = Path(__file__).parent

    def key(item) -> int:
        return rank.get(Path(item.fspath).relative_to(tests).as_posix(), len(rank))

    items.sort(key=key)
