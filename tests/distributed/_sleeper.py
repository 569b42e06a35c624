"""A process that never ends by itself (no JAX): for the launcher's timeout and SIGTERM.

``--save-on-sigterm S``: on SIGTERM it "saves" for S seconds and exits 0, as a
preempted trainer does.
"""

import os
import signal
import sys
import time


def _save_and_exit(seconds: float):
    def handler(signum, frame):
        time.sleep(seconds)
        print(f"saved after {seconds} s", flush=True)
        sys.exit(0)

    return handler


if __name__ == "__main__":
    if sys.argv[1:2] == ["--save-on-sigterm"]:
        signal.signal(signal.SIGTERM, _save_and_exit(float(sys.argv[2])))
    print(f"sleeping as {os.getpid()}", flush=True)
    time.sleep(600)
