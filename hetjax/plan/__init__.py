"""Cost model and layout planner (pure Python; no JAX program is built or compiled).

- :mod:`~hetjax.plan.hardware` - hardware profiles as data (``h100``, ``h200``, ``cpu``),
  read from the calibrated files in ``hetjax/plan/profiles/``.
- :func:`estimate` - a :class:`Plan`'s step time, tokens/s, TFLOPS/GPU, memory per GPU.
- :func:`search` - the best heterogeneous and homogeneous plans for a model, a GPU count
  and a workload, under the memory limit.
- :mod:`~hetjax.plan.calibrate` - fit a profile's constants to measured times.

Example:
    >>> from models.config import paper_preset  # doctest: +SKIP
    >>> cfg = paper_preset("vit-6b", "llm-120b")  # doctest: +SKIP
    >>> r = search(cfg, 256, Workload(512, 8192, 4), "h100")  # doctest: +SKIP
    >>> print(r.best.plan, f"{r.gain_pct:+.1f}%")  # doctest: +SKIP
"""

from .cost import MODES as MODES
from .cost import Estimate as Estimate
from .cost import Plan as Plan
from .cost import Workload as Workload
from .cost import check_plan as check_plan
from .cost import estimate as estimate
from .cost import homogeneous as homogeneous
from .hardware import PROFILES as PROFILES
from .hardware import HardwareProfile as HardwareProfile
from .hardware import get_profile as get_profile
from .search import SearchResult as SearchResult
from .search import search as search
from .stage import ModulePlan as ModulePlan
from .stage import StageCost as StageCost

__all__ = [
    "MODES",
    "PROFILES",
    "Estimate",
    "HardwareProfile",
    "ModulePlan",
    "Plan",
    "SearchResult",
    "StageCost",
    "Workload",
    "check_plan",
    "estimate",
    "get_profile",
    "homogeneous",
    "search",
]
