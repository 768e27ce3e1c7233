"""``python -m memsaver``: launch helpers.

python -m memsaver env            shell lines for preload mode (eval "$(python -m memsaver env)")
python -m memsaver env --json     the same variables as JSON (e.g. for Ray's runtime_env)
python -m memsaver preload-path   the libmemsaver.so to preload
python -m memsaver stats          hook mode, library and stats of this process (a load check)
python -m memsaver check FILE...  validate pause/resume profiles (no GPU needed)
python -m memsaver run FILE STAGE run one stage of a profile (call steps are skipped)
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
    check = sub.add_parser("check", help="validate pause/resume profiles (YAML)")
    check.add_argument("files", nargs="+", metavar="FILE")
    run = sub.add_parser("run", help="run one stage of a profile in this process")
    run.add_argument("file", metavar="FILE")
    run.add_argument("stage", metavar="STAGE")
    return p


def _check(files: list[str]) -> int:
    import memsaver

    status = 0
    for f in files:
        try:
            p = memsaver.load_profile(f)
        except (OSError, memsaver.MemsaverError) as e:
            print(f"{e}", file=sys.stderr)
            status = 1
            continue
        calls = p.callbacks()
        print(
            f"{f}: ok (version {p.version}; tags: {', '.join(sorted(p.tags))}; "
            f"stages: {', '.join(sorted(p.stages))}"
            + (f"; callbacks: {', '.join(calls)})" if calls else ")")
        )
    return status


def _run(file: str, stage: str) -> int:
    import memsaver

    try:
        report = memsaver.load_profile(file).run(stage, skip_calls=True)
    except (OSError, memsaver.MemsaverError) as e:
        print(f"memsaver: {e}", file=sys.stderr)
        return 1
    print(report)
    return 0


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
            f"{parser.prog}: error: a command is required (env, preload-path, stats, check, run)",
            file=sys.stderr,
        )
        return 2
    from memsaver import _launch

    if args.command == "check":
        return _check(args.files)
    if args.command == "run":
        return _run(args.file, args.stage)
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
