"""``python -m memsaver``: launch helpers.

python -m memsaver env            shell lines for preload mode (eval "$(python -m memsaver env)")
python -m memsaver env --json     the same variables as JSON (e.g. for Ray's runtime_env)
python -m memsaver preload-path   the libmemsaver.so to preload
python -m memsaver stats          hook mode, library and stats of this process (a load check)
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _prog() -> str:
    return "python -m memsaver" if sys.argv[0].endswith("__main__.py") else "memsaver"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="Launch helpers of memsaver (pause and resume tagged GPU memory).",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser(
        "env",
        help="print the environment a launcher needs for preload mode",
        description='Print shell lines for preload mode: eval "$(python -m memsaver env)".',
    )
    env.add_argument("--json", action="store_true", help="print the variables as a JSON object")
    sub.add_parser("preload-path", help="print the path of the libmemsaver.so to preload")
    sub.add_parser("stats", help="load memsaver in this process and print its hook mode and stats")
    return p


def _stats() -> int:
    import memsaver
    from memsaver import _memsaver

    try:
        mode = memsaver.hook_mode()
        s = memsaver.stats()
    except memsaver.MemsaverError as e:
        print(f"memsaver: {e}", file=sys.stderr)
        return 1
    loaded = _memsaver.loaded()
    print(f"hook mode: {mode}")
    print(f"library:   {loaded[1] if loaded else '?'}")
    print(f"driver:    {os.environ.get('MEMSAVER_CUDA_LIB') or 'libcuda.so.1'}")
    print(s)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m memsaver`` and of the ``memsaver`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)  # exits with status 2 on an unknown command
    if args.command is None:
        parser.print_usage(sys.stderr)
        print(
            f"{parser.prog}: error: a command is required (env, preload-path, stats)",
            file=sys.stderr,
        )
        return 2
    from memsaver import _launch

    if args.command == "env":
        if args.json:
            print(json.dumps(_launch.subprocess_env(), indent=2))
        else:
            print(_launch.env_script(), end="")
        return 0
    if args.command == "preload-path":
        print(_launch.preload_path())
        return 0
    return _stats()


if __name__ == "__main__":
    sys.exit(main())
