"""The host loop: dispatch order, metrics handed to hooks, and the three stock hooks."""

import io
import json
import re

import jax.numpy as jnp
import pytest

from hetjax.runtime import JsonlWriter, ProgressBar, Summary, run_training


class Recorder:
    def __init__(self, log):
        self.log, self.steps, self.history = log, [], None

    def on_step(self, step, metrics):
        self.log.append(("hook", step))
        self.steps.append(dict(metrics))

    def on_end(self, history):
        self.history = history


def test_dispatches_next_step_before_reading_previous():
    log = []

    def step_fn(i):
        log.append(("dispatch", i))
        return {"loss": jnp.float32(10.0 - i)}

    rec = Recorder(log)
    history = run_training(step_fn, 3, tokens_per_step=64, hooks=[rec])
    assert log == [
        ("dispatch", 0),
        ("dispatch", 1),
        ("hook", 0),
        ("dispatch", 2),
        ("hook", 1),
        ("hook", 2),
    ]
    assert [m["step"] for m in history] == [0, 1, 2]
    assert [m["loss"] for m in history] == [10.0, 9.0, 8.0]
    assert rec.history == history
    for m in history:
        assert all(type(v) in (int, float) for v in m.values())
        assert m["tokens"] == 64 and m["step_time_s"] >= 0
        assert m["tokens_per_s"] == pytest.approx(64 / max(m["step_time_s"], 1e-9))


def test_jsonl_writer(tmp_path):
    path = tmp_path / "m.jsonl"
    run_training(
        lambda i: {"loss": jnp.float32(i), "grad_norm": jnp.float32(2 * i)},
        2,
        tokens_per_step=8,
        hooks=[JsonlWriter(str(path))],
    )
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(next(iter(r)) == "step" for r in rows)
    assert rows[1]["grad_norm"] == 2.0 and rows[1]["tokens"] == 8


def test_progress_bar_and_summary_text():
    bar_out, summary_out = io.StringIO(), io.StringIO()
    run_training(
        lambda i: {"loss": jnp.float32(5.0 - i)},
        25,
        tokens_per_step=100,
        hooks=[
            ProgressBar(25, stream=bar_out, every=10),
            Summary({"model": "tiny"}, stream=summary_out),
        ],
    )
    lines = bar_out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert lines[0].endswith("eta -") and re.search(
        r"loss -19\.0000 .* eta \d:\d\d:\d\d$", lines[-1]
    )
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", bar_out.getvalue())  # a file: plain
    text = summary_out.getvalue()
    assert "hetjax run summary" in text and "tiny" in text
    assert "5.0000 -> -19.0000" in text and "steps" in text


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_redraws_one_line():
    out = Terminal()
    run_training(
        lambda i: {"loss": jnp.float32(5.0 - i)},
        3,
        tokens_per_step=100,
        hooks=[ProgressBar(3, stream=out)],
    )
    text = out.getvalue()
    assert "\x1b[" in text  # drawn in place
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert "step     3/3" in plain and "loss 3.0000" in plain and "tok/s" in plain


def test_blocking_dispatch_bills_every_step_its_own_time():
    """A dispatch that waits for the devices (as on CPU) returns metrics already computed:
    the last step must not get ~0 seconds (and an absurd tokens/s)."""
    import time

    def step_fn(i):
        time.sleep(0.05)  # the step runs during its dispatch
        return {"loss": jnp.float32(i)}

    history = run_training(step_fn, 4, tokens_per_step=64)
    times = [m["step_time_s"] for m in history]
    assert all(t > 0.02 for t in times), times
    assert sum(times) == pytest.approx(0.2, rel=0.5)


class _Late:
    """A device value that becomes ready ``delay`` seconds after its dispatch returned."""

    def __init__(self, value: float, delay: float):
        import time

        self.value, self.at = value, time.perf_counter() + delay

    def is_ready(self):
        import time

        return time.perf_counter() >= self.at

    def block_until_ready(self):
        import time

        time.sleep(max(0.0, self.at - time.perf_counter()))
        return self

    def __float__(self):
        self.block_until_ready()
        return self.value


def test_a_dispatch_that_runs_most_of_its_step_bills_the_last_step_its_own_time():
    """Each dispatch waits for most of its own step and leaves a short tail on the
    devices (the executor on CPU): the last step's time is like the others', not the
    tail alone (a 30-step run printed 73,154 tokens/s for its last step, ~5,000 before)."""
    import time

    def step_fn(i):
        time.sleep(0.05)
        return {"loss": _Late(float(i), 0.01)}

    history = run_training(step_fn, 5, tokens_per_step=64)
    times = [m["step_time_s"] for m in history]
    assert all(t > 0.035 for t in times), times
    assert times[-1] == pytest.approx(sum(times[1:-1]) / 3, rel=0.5), times


def test_stop_ends_the_run_after_the_step_it_is_asked_at():
    stopped = []

    def step_fn(i):
        if i == 2:
            stopped.append(i)
        return {"loss": jnp.float32(i)}

    history = run_training(step_fn, 6, tokens_per_step=8, stop=lambda: bool(stopped))
    assert [m["step"] for m in history] == [0, 1, 2]


def test_a_failing_step_releases_the_terminal_and_keeps_the_finished_rows(tmp_path):
    out, path = Terminal(), tmp_path / "m.jsonl"
    bar = ProgressBar(5, stream=out)

    def step_fn(i):
        if i == 3:
            raise RuntimeError("device lost")
        return {"loss": jnp.float32(5.0 - i)}

    with pytest.raises(RuntimeError, match="device lost"):
        run_training(step_fn, 5, tokens_per_step=100, hooks=[bar, JsonlWriter(str(path))])
    assert not bar.progress.live.is_started  # the live display gave the terminal back
    assert out.getvalue().endswith("\x1b[?25h")  # ... with the cursor shown again
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
