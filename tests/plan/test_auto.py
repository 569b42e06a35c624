"""``--layout auto``: the planner's plan for ``tiny`` on 8 devices trains with parity."""

import jax

from experiments.plan import auto_plans, hetjax_workload, layout_choices
from models.config import get_preset
from tests import launch
from tests.runtime.parity import Case, check_matches_reference, reference

GLOBAL_BATCH = 16


def test_auto_plan_trains_tiny_like_the_reference():
    cfg = get_preset("tiny")
    work = hetjax_workload(GLOBAL_BATCH, cfg.seq_len, act_bytes=4)
    ests = auto_plans(
        cfg, len(jax.devices()), work, gpu="cpu", zero1=False, sequence_parallel=False
    )
    assert ests and all(e.fits for e in ests)
    ref = reference("tiny", GLOBAL_BATCH)

    def runs(choice) -> bool:  # the first of the planner's list the model takes
        try:
            ref.model.validate_layouts(choice.layouts, seq_len=cfg.seq_len)
        except ValueError:
            return False
        return True

    est, choice = next((e, c) for e, c in zip(ests, layout_choices(ests), strict=True) if runs(c))
    texts = tuple((name, str(layout)) for name, layout in choice.layouts.items())
    case = Case("tiny", choice.mode, texts, choice.microbatches)
    assert est.plan.mode in ("colocated", "non-colocated")
    check_matches_reference(case, ref)


def test_layout_auto_flag_and_one_line_errors():
    from experiments import flags

    config = flags.parse_args(["--layout", "auto"], prog="llava_train")
    assert config.parallel.layouts == {"auto": "auto"}
    bad = launch.run_main(launch.TRAIN, "--layout", "auto", "--steps", "1", "--model", "tiny-av")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "plans one vision encoder" in bad.stderr
