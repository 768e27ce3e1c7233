"""``python -m memsaver``: launch helpers.

python -m memsaver env            shell lines for preload mode (eval "$(python -m memsaver env)")
python -m memsaver env --json     the same variables as JSON (e.g. for Ray's runtime_env)
python -m memsaver preload-path   the libmemsaver.so to preload
python -m memsaver stats          hook mode, library and stats of this process (a load check)
python -m memsaver check FILE...  validate pause/resume profiles (no GPU needed)
python -m memsaver run FILE STAGE run one stage of a profile (call steps are skipped)
python -m memsaver demo PROFILE [-o DIR]
                                  run a profile's sleep and wake stages on tagged memory and
                                  write its timeline page (GPU, or the fake driver)
python -m memsaver timeline EVENTS.json... -o OUT.html [--png OUT.png]
                                  chart recorded events (MEMSAVER_TIMELINE=PATH records them)
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
    demo = sub.add_parser("demo", help="run a profile's sleep and wake stages and chart them")
    demo.add_argument("profile", metavar="PROFILE")
    demo.add_argument("-o", "--output", default=".", metavar="DIR")
    tl = sub.add_parser("timeline", help="render recorded events into a self-contained HTML page")
    tl.add_argument("events", nargs="+", metavar="EVENTS.json")
    tl.add_argument("-o", "--output", required=True, metavar="OUT.html")
    tl.add_argument("--png", metavar="OUT.png", help="also a screenshot, with headless Chromium")
    tl.add_argument("--title", default="memsaver timeline")
    return p


def _timeline(events: list[str], out: str, png: str | None, title: str) -> int:
    from memsaver import timeline

    try:
        timeline.write_html(events, out, title)
    except (OSError, ValueError, KeyError) as e:
        print(f"memsaver: cannot render {', '.join(events)}: {e}", file=sys.stderr)
        return 1
    print(out)
    if png:
        try:
            timeline.screenshot(out, png)
        except (OSError, RuntimeError) as e:
            print(f"memsaver: {e}", file=sys.stderr)
            return 1
        print(png)
    return 0


def _demo(profile_path: str, out_dir: str) -> int:
    import memsaver
    from memsaver import _memsaver, timeline

    try:
        profile = memsaver.load_profile(profile_path)
        free, total = memsaver.device_memory(0)
    except (OSError, memsaver.MemsaverError) as e:
        print(f"memsaver: {e}", file=sys.stderr)
        return 1
    # Gigabytes on a real GPU, megabytes on the fake driver (host memory).
    unit = 32 << 20 if total > (32 << 30) and "fake" not in os.environ.get("MEMSAVER_CUDA_LIB", "") else 1 << 20
    sizes = {"weights": 64, "kv_cache": 256, "cuda_graph": 8}
    timeline.enable()
    ptrs = [
        _memsaver.malloc(sizes.get(tag, 16) * unit, 0, tag, backup)
        for tag, backup in profile.tags.items()
        if tag != "nccl"
    ]
    print(f"{profile_path}: {len(ptrs)} tags allocated on device 0 ({free / (1 << 30):.1f} GiB free of "
          f"{total / (1 << 30):.1f} GiB)")
    callbacks = {name: (lambda: None) for name in profile.callbacks()}
    try:
        for stage in ("sleep", "wake"):
            print(profile.run(stage, callbacks=callbacks))
    except memsaver.MemsaverError as e:
        print(f"memsaver: {e}", file=sys.stderr)
        return 1
    finally:
        for p in ptrs:
            _memsaver.free(p)
    os.makedirs(out_dir, exist_ok=True)
    events = timeline.save(os.path.join(out_dir, "demo-events.json"))
    page = timeline.write_html([events], os.path.join(out_dir, "demo-timeline.html"),
                               f"memsaver demo: {os.path.basename(profile_path)}")
    print(f"timeline: {page}")
    if timeline.browser():
        print(f"screenshot: {timeline.screenshot(page, os.path.join(out_dir, 'demo-timeline.png'))}")
    return 0


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
            f"{parser.prog}: error: a command is required (env, preload-path, stats, check, run, demo, timeline)",
            file=sys.stderr,
        )
        return 2
    from memsaver import _launch

    if args.command == "demo":
        return _demo(args.profile, args.output)
    if args.command == "timeline":
        return _timeline(args.events, args.output, args.png, args.title)
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
