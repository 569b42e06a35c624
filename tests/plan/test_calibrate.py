"""The efficiency fit recovers a known curve; bad samples get one line."""

import pytest

from hetjax.plan import get_profile
from hetjax.plan.calibrate import fit_matmul


def test_fit_recovers_rate_and_knee():
    rate, knee = 5e9, 64.0
    samples = [(w, 2e9 * w, 2e9 * w * (w + knee) / (rate * w)) for w in (16, 64, 256, 1024)]
    fit = fit_matmul(samples)
    assert fit.tflops == pytest.approx(rate / 1e12) and fit.knee == pytest.approx(knee)
    assert fit.max_rel_error < 1e-9
    hw = fit.apply(get_profile("cpu"))
    assert hw.matmul_tflops(1e12) == pytest.approx(rate / 1e12)


def test_one_width_is_not_enough():
    with pytest.raises(ValueError, match="two different widths"):
        fit_matmul([(64, 1e9, 1.0), (64, 2e9, 2.0)])
