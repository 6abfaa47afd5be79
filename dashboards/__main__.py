"""``python -m stagetrace.dashboards [--check]``: write the dashboards' JSON under ``generated/``.

With ``--check``, write nothing and exit 1 when a committed file differs from what its builder produces.
"""

from __future__ import annotations

import argparse
import sys

from stagetrace import dashboards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stagetrace.dashboards", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that differ from the builders")
    args = parser.parse_args(argv)
    folder = dashboards.GENERATED
    built = {folder / f"{uid}.json": dashboards.render(d) for uid, d in dashboards.build_all().items()}
    stale = [path for path, text in built.items() if not path.exists() or path.read_text() != text]
    orphans = sorted(set(folder.glob("*.json")) - set(built)) if folder.exists() else []
    if args.check:
        for path in stale:
            print(f"{path} differs from its builder", file=sys.stderr)
        for path in orphans:
            print(f"{path} has no builder", file=sys.stderr)
        if stale or orphans:
            print("regenerate with: python -m stagetrace.dashboards", file=sys.stderr)
        return 1 if stale or orphans else 0
    folder.mkdir(exist_ok=True)
    for path in stale:
        path.write_text(built[path])
        print(f"wrote {path}")
    for path in orphans:
        path.unlink()
        print(f"removed {path} (no builder)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
