"""``experiments.cli.run_cli``: a :class:`ConfigError` is one line on stderr and exit 2,
even when the failed work leaves objects behind whose clean-up raises at interpreter exit
(a damaged checkpoint leaves orbax's pending tensorstore reads: their coroutines are
collected after their event loop closed, and Python would print each as "Exception
ignored in ..."), a background thread fails after the line, or native code writes to the
process's stderr at exit."""

import textwrap

from tests import launch

SCRIPT = textwrap.dedent(
    """
    import atexit
    import os
    import threading
    import time

    from experiments.cli import ConfigError, run_cli

    class LeftBehind:  # what a failed library call may leave: its clean-up raises
        def __del__(self):
            raise RuntimeError("Event loop is closed")

    def late_reader():  # a background read that fails after the error line
        time.sleep(0.5)
        raise OSError("tensorstore: unexpected end of file")

    def at_exit():  # and native code that writes to fd 2 at interpreter exit
        os.write(2, b"E0000 00:00:00 tensorstore.cc:1] read failed\\n")

    def main(argv):
        main.left = [LeftBehind() for _ in range(3)]  # collected at interpreter exit
        threading.Thread(target=late_reader).start()  # non-daemon: exit waits for it
        atexit.register(at_exit)
        raise ConfigError("checkpoint x is damaged or incomplete; delete it")

    run_cli(main, "prog")
    """
)


def test_config_error_is_one_line_despite_teardown_noise():
    out = launch.run_code(SCRIPT, timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "prog: error: checkpoint x is damaged or incomplete; delete it"
    ], out.stderr
