import sys


def run() -> int:
    """The command line's entry point (``stagetrace`` and ``python -m stagetrace``): a Ctrl-C while the command line
    is still being imported ends it quietly with 130, as one later does (``cli.main``)."""
    try:
        from stagetrace.cli import main
    except KeyboardInterrupt:
        print("stagetrace: interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
