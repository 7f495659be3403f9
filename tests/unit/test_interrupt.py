"""runtime/interrupt.py's ``installed`` block: its own hooks go when it ends; a hook installed
inside it stays (the checkpointer's, which keeps orbax's failed-read coroutines, collected when
the process exits after the block, from printing "Exception ignored" — issue 48's one-line rule;
tests/integration/test_disk_faults.py saw the dump when the block removed it)."""

import sys

from nnxtron.runtime import interrupt


def test_its_own_hooks_go_when_the_block_ends():
    before = sys.unraisablehook, sys.excepthook
    with interrupt.installed(interrupt.handle):
        assert sys.unraisablehook is not before[0] and sys.excepthook is not before[1]
    assert (sys.unraisablehook, sys.excepthook) == before


def test_a_hook_installed_inside_the_block_stays():
    before = sys.unraisablehook, sys.excepthook

    def unraisable(info) -> None: ...

    def excepthook(kind, value, tb) -> None: ...

    try:
        with interrupt.installed(interrupt.handle):
            sys.unraisablehook, sys.excepthook = unraisable, excepthook
        assert sys.unraisablehook is unraisable and sys.excepthook is excepthook
    finally:
        sys.unraisablehook, sys.excepthook = before
