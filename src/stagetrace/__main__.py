import sys


def run() -> int:
    """The command line's entry point (``stagetrace`` and ``python -m stagetrace``): a Ctrl-C while the command line
    is still being imported ends it quietly with 130, as one later does (``cli.main``)."""
    try:
        from stagetrace.cli import main
    except KeyboardInterrupt:
        print("stagetrace: interrupted", file=sys.stderr)
        status = 130
    else:
        status = main()
    _forget_handled_interrupts()
    return status


def _forget_handled_interrupts() -> None:
    """Keep the exit status ``run`` returns after a Ctrl-C it handled.

    CPython marks a KeyboardInterrupt that leaves an ``exec`` or ``eval`` of a string as unhandled, in a process-wide
    flag, even when a caller catches it later; the imports of a command build classes through such code (dataclasses
    and namedtuple generate their methods so). Under ``python -m`` the interpreter, seeing the flag at exit, kills
    itself with SIGINT in place of the status, so a Ctrl-C during the imports ended the demo by SIGINT now and then.
    Each evaluation of a string clears the flag as it starts, hence the empty one: ``run`` returned, so nothing went
    unhandled (an interrupt that escapes ``run`` sets the flag again, and still ends the process by SIGINT)."""
    exec("")  # noqa: S102 -- a constant, empty string


if __name__ == "__main__":
    sys.exit(run())
