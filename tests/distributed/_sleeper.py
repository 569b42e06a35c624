"""A process that never ends by itself (no JAX): for the launcher's timeout and SIGTERM."""

import os
import time

if __name__ == "__main__":
    print(f"sleeping as {os.getpid()}", flush=True)
    time.sleep(600)
