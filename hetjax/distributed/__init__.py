"""Multi-process start-up, a launch-consistency check and a fault watchdog.

A multi-process JAX job is N copies of one program that must agree on everything
(layouts, seeds, model, steps) and issue the same collectives in the same order. Three
things go wrong in practice, and one module here handles each:

- **Start-up** (:mod:`.initialize`). :func:`initialize` wraps
  ``jax.distributed.initialize`` and finds its arguments in one place: explicit
  arguments, else the ``HETJAX_*`` variables that ``python -m hetjax.launch`` sets, else
  a SLURM / Open MPI job that JAX detects by itself, else a plain single-process run.
- **Mismatched launches** (:mod:`.consistency`). :func:`check_consistent` refuses a run
  whose processes were started with different settings, in one line on every process.
- **A dead peer** (:mod:`.watchdog`). :func:`watch_peers` stops the survivors of a crash
  within about a second (a peer on another machine: once its heartbeat is ``timeout_s``
  old) with one line naming the peer, instead of leaving them in a collective until
  JAX's heartbeat timeout aborts them with a C++ stack trace; :func:`fail` reports a
  handled error the same way.

Example::

    info = hetjax.distributed.initialize(cpu=True)  # under python -m hetjax.launch
    hetjax.distributed.check_consistent("config", dataclasses.asdict(config))
    hetjax.distributed.watch_peers()
"""

from .consistency import check_consistent as check_consistent
from .initialize import ENV_COORDINATOR as ENV_COORDINATOR
from .initialize import ENV_LOCAL_DEVICES as ENV_LOCAL_DEVICES
from .initialize import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from .initialize import ENV_PROCESS_ID as ENV_PROCESS_ID
from .initialize import DistributedInfo as DistributedInfo
from .initialize import initialize as initialize
from .initialize import resolve as resolve
from .watchdog import PEER_FAILED_EXIT_CODE as PEER_FAILED_EXIT_CODE
from .watchdog import fail as fail
from .watchdog import watch_peers as watch_peers

__all__ = [
    "ENV_COORDINATOR",
    "ENV_LOCAL_DEVICES",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "PEER_FAILED_EXIT_CODE",
    "DistributedInfo",
    "check_consistent",
    "fail",
    "initialize",
    "resolve",
    "watch_peers",
]
