"""``python -m experiments.gpu_check``: see the package docstring."""

from experiments.cli import run_cli
from experiments.gpu_check import main, parse_args


def _run(argv: list[str]) -> int:
    main(parse_args(argv))
    return 0


if __name__ == "__main__":
    run_cli(_run, "gpu_check")
