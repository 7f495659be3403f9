"""The ``nnxtron`` command (``pyproject.toml``'s console script) and ``python -m nnxtron``.

The first code that runs: it installs the start-up SIGINT handling (``runtime/interrupt.py``:
``at_start``) before anything heavy is imported, so a Ctrl-C at any moment of the start-up, even
while JAX's extension modules load, ends the command with one line and status 130, never a
traceback or a crash; then it runs the command line (``cli.main``).
"""

import sys

from nnxtron.runtime import interrupt


def main() -> int:
    with interrupt.installed(interrupt.at_start):
        from nnxtron.cli import main as run

        code = run()
        if interrupt.received() and code != 128 + 2:  # a KeyboardInterrupt a library swallowed: the command still stops
            print(interrupt.STARTING, file=sys.stderr)
            return 128 + 2
    return code


if __name__ == "__main__":
    sys.exit(main())
