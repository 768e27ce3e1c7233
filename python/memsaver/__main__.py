"""The ``memsaver`` command (also ``python -m memsaver``): every subcommand, one entry point.

``demo`` without a profile, ``bench`` and ``options`` run on the allocator core inside
libmemsaver.so (``memsaver_cli_main``); the others are Python. ``memsaver --help`` lists them,
``memsaver COMMAND --help`` describes one. The core's commands and their flags are declared
once, in the core (``torch-shim/src/cli/mod.rs``, ``COMMANDS``): their parsers here are built
from the table it gives (``memsaver_cli_spec_json``). So are their subcommands (``bench
nccl``), which run here: the core declares them and refuses to run them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

#: The core's command that the Python package extends (with a profile); the core's other
#: commands are run as given, their flags parsed by the core.
_EXTENDED = "demo"

#: The Python implementations of the core's subcommands (declared in its table), by
#: (command, subcommand): each takes the parsed flags by name (``--ranks`` -> ``ranks``,
#: strings; None or False when not given) and returns the exit status.
_SUBCOMMANDS = {("bench", "nccl"): "_bench_nccl"}


def _core_spec() -> list[dict[str, Any]] | None:
    """The core's commands and their flags (``memsaver_cli_spec_json``), or None when
    libmemsaver.so cannot be loaded (running one of them then says why)."""
    try:
        from memsaver import _core as core
        from memsaver import _memsaver

        core.library()
        return list(json.loads(_memsaver.cli_spec())["commands"])
    except Exception:  # noqa: BLE001 - any failure to load means: no core commands to list
        return None


def _core_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, command: dict[str, Any]) -> None:
    """Adds the core command's flags to ``p``, as the core declares them; each is stored under
    ``core_<name>``, None (or False) when not given, so the core applies its own default."""
    for f in command["flags"]:
        dest = "core_" + f["name"].lstrip("-").replace("-", "_")
        if f["value"] is None:
            p.add_argument(f["name"], dest=dest, action="store_true", help=f["help"])
        else:
            p.add_argument(
                f["name"], dest=dest, metavar=f["value"], help=f"{f['help']} (default {f['default']})"
            )


def _core_argv(args: argparse.Namespace, command: dict[str, Any]) -> list[str]:
    """The core command's arguments back from the flags ``_core_flags`` parsed."""
    argv = [command["name"]]
    for f in command["flags"]:
        v = getattr(args, "core_" + f["name"].lstrip("-").replace("-", "_"))
        if v is True:
            argv.append(f["name"])
        elif v not in (None, False):
            argv += [f["name"], v]
    return argv


def _prog() -> str:
    return "python -m memsaver" if sys.argv[0].endswith("__main__.py") else "memsaver"


def _parser(spec: list[dict[str, Any]] | None) -> argparse.ArgumentParser:
    from memsaver import __version__

    p = argparse.ArgumentParser(
        prog=_prog(),
        description="memsaver: pause and resume tagged GPU memory at fixed addresses.",
        epilog="'COMMAND --help' describes a command. Docs: README.md, docs/profiles.md, docs/options.md.",
    )
    p.add_argument("--version", action="version", version=f"memsaver {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="a staged pause/resume cycle (core), or a profile's sleep and wake with its timeline",
        description="Without PROFILE: a staged pause/resume cycle of tagged memory on the allocator "
        "core, printing resident memory per tag per stage and checking that kept contents come "
        "back bit-exact. With PROFILE: its sleep and wake stages on tagged memory through the "
        "Python package, writing the timeline page to DIR. Real GPU when one is present, else "
        "the fake driver.",
    )
    demo.add_argument("profile", nargs="?", metavar="PROFILE", help="a profile with sleep and wake stages")
    demo.add_argument("-o", "--output", default=".", metavar="DIR", help="where the profile demo writes its timeline")
    for command in spec or []:
        if command["name"] == _EXTENDED:
            _core_flags(demo.add_argument_group("the core demo (without PROFILE)"), command)

    check = sub.add_parser(
        "check",
        help="validate pause/resume profiles (YAML); no GPU needed",
        description="Validate profiles; errors name file:line:column (exit status 1 if any is invalid).",
    )
    check.add_argument("files", nargs="+", metavar="FILE")

    run = sub.add_parser(
        "run",
        help="run one stage of a profile in other processes (--pid/--group), or in this one",
        description="Run one stage of a profile. With --pid or --group: in those processes, which "
        "must serve control requests (MEMSAVER_CONTROL=1 or memsaver.serve_control()); their call "
        "steps run the callbacks they registered (memsaver.register_callback), and a stage calling "
        "one they did not register fails before any step runs. Without: in this process, which "
        "holds no memory unless it allocated some, and whose call steps are skipped (reported so).",
    )
    run.add_argument("file", metavar="FILE")
    run.add_argument("stage", metavar="STAGE")
    _target_options(run)

    for name, verb in (("pause", "release"), ("resume", "map again")):
        c = sub.add_parser(
            name,
            help=f"{name} tags of other processes (--pid or --group)",
            description=f"{name.capitalize()} (device memory: {verb}) TAGs in other processes, which "
            "must serve control requests (MEMSAVER_CONTROL=1 or memsaver.serve_control()); "
            "no TAG: every tag. Exit status 1 if any process failed.",
        )
        c.add_argument("tags", nargs="*", metavar="TAG")
        _target_options(c, required=True)

    st = sub.add_parser(
        "stats",
        help="stats of other processes (--pid/--group), or load memsaver here and print this process's",
        description="With --pid or --group: the stats of those processes. Without: load "
        "libmemsaver.so in this process and print its hook mode, library and stats.",
    )
    _target_options(st)
    st.add_argument("--json", action="store_true", help="print the answers as JSON")

    tl = sub.add_parser(
        "timeline",
        help="render recorded events into a self-contained HTML page, or export a Chrome trace",
        description="Chart events recorded with MEMSAVER_TIMELINE=PATH or memsaver.timeline.enable() "
        "(all processes on one time axis), and/or export them in the Chrome trace event format "
        "(Perfetto: ui.perfetto.dev -> Open trace file; chrome://tracing).",
    )
    tl.add_argument("events", nargs="+", metavar="EVENTS.json")
    tl.add_argument("-o", "--output", metavar="OUT.html", help="the HTML page")
    tl.add_argument("--png", metavar="OUT.png", help="also a full-page screenshot of OUT.html, with headless Chromium")
    tl.add_argument("--trace", metavar="OUT.json", help="the events in the Chrome trace event format")
    tl.add_argument("--title", default="memsaver timeline")

    env = sub.add_parser(
        "env",
        help="print the environment a launcher needs for preload mode",
        description='Print shell lines for preload mode: eval "$(memsaver env)".',
    )
    env.add_argument("--json", action="store_true", help="print the variables as a JSON object")

    sub.add_parser(
        "preload-path",
        help="print the path of the libmemsaver.so to preload",
        description="Print the path of the libmemsaver.so to preload (LD_PRELOAD).",
    )
    # The core's other commands, as it declares them; it parses their flags itself
    # (memsaver_cli_main), these parsers list them for --help.
    for command in spec or []:
        if command["name"] != _EXTENDED:
            subs = "".join(
                f"; '{command['name']} {s['name']}': {s['help'].split(':')[0]} ({command['name']} {s['name']} --help)"
                for s in command.get("subcommands", [])
            )
            c = sub.add_parser(command["name"], help=command["help"] + subs, description=command["help"] + subs)
            _core_flags(c, command)
    sub.add_parser(
        "diagnostics",
        help="check the installation: library, driver, devices, variables, runtime directory",
        description="Print the version, library and hook mode, driver and devices, the MEMSAVER_* "
        "variables, the runtime directory and nccl_stats(), going on past problems; exit status 1 "
        "if something is wrong, with a line saying what to do.",
    )
    return p


def _subcommand(spec: list[dict[str, Any]], args: list[str]) -> int | None:
    """Runs ``args`` when it names a subcommand of one of the core's commands (``bench nccl
    ...``), in Python; None when it does not."""
    import importlib

    if len(args) < 2 or (args[0], args[1]) not in _SUBCOMMANDS:
        return None
    command = next((c for c in spec if c["name"] == args[0]), None)
    declared = next((s for s in (command or {}).get("subcommands", []) if s["name"] == args[1]), None)
    if declared is None:
        print(f"{_prog()}: error: this libmemsaver.so does not declare '{args[0]} {args[1]}': "
              "reinstall memsaver", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog=f"{_prog()} {args[0]} {args[1]}", description=declared["help"])
    _core_flags(p, declared)
    parsed = p.parse_args(args[2:])
    flags = {k.removeprefix("core_"): v for k, v in vars(parsed).items()}
    module = importlib.import_module(f"memsaver.{_SUBCOMMANDS[(args[0], args[1])]}")
    return int(module.main(flags))


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    """The names of the parser's subcommands."""
    for a in parser._actions:  # noqa: SLF001 - argparse has no public accessor for them
        if isinstance(a, argparse._SubParsersAction):  # noqa: SLF001
            return list(a.choices)
    return []


def _target_options(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--pid", type=int, metavar="PID", help="the process to act on")
    p.add_argument(
        "--group",
        type=int,
        metavar="G",
        help="every process of group G (with --pid: the group PID is in; default: MEMSAVER_GROUP)",
    )
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds to wait per process (600)")
    if required:
        p.set_defaults(_target_required=True)


def _remote(args: argparse.Namespace, op: str, **fields: object) -> int:
    """Sends ``op`` to the processes --pid/--group name; one line (or report) per process."""
    from memsaver import control

    addressed: control._Addressed
    if args.pid is not None:
        addressed = control.Target(args.pid, args.group, args.timeout)
    else:
        addressed = control.group(args.group, args.timeout)
    answers = addressed.send(op, **fields)
    if getattr(args, "json", False):
        print(json.dumps([_answer_json(a) for a in answers], indent=2))
        return 0 if all(a.ok for a in answers) else 1
    what = {
        "pause": "paused " + (", ".join(fields.get("tags", [])) or "every tag"),  # type: ignore[arg-type]
        "resume": "resumed " + (", ".join(fields.get("tags", [])) or "every tag"),  # type: ignore[arg-type]
    }
    for a in answers:
        who = f"process {a.pid} (group {a.group})"
        if not a.ok:
            print(f"{who}: FAILED: {a.error}", file=sys.stderr)
        elif op in what:
            print(f"{who}: {what[op]}")
        else:
            print(f"{who}:\n{a.result}")
    failed = [a for a in answers if not a.ok]
    if failed:
        print(f"memsaver: {len(failed)} of {len(answers)} processes failed", file=sys.stderr)
    return 1 if failed else 0


def _answer_json(a: object) -> dict[str, object]:
    import dataclasses

    d = dataclasses.asdict(a)  # type: ignore[call-overload]
    if d["result"] is not None:
        d["result"] = json.loads(json.dumps(d["result"], default=str))
    return d  # type: ignore[no-any-return]


def _core(args: list[str]) -> int:
    """Runs a command of the allocator core (in libmemsaver.so) and returns its exit status."""
    from memsaver import _core as core
    from memsaver import _memsaver

    try:
        core.library()
    except _memsaver.MemsaverError as e:
        print(f"memsaver: {e}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    return int(_memsaver.cli_main(args))


def _timeline(events: list[str], out: str | None, png: str | None, trace: str | None, title: str) -> int:
    from memsaver import timeline

    if out is None and trace is None:
        print("memsaver timeline: give -o OUT.html, --trace OUT.json or both", file=sys.stderr)
        return 2
    if png and out is None:
        print("memsaver timeline: --png screenshots the page: give -o OUT.html too", file=sys.stderr)
        return 2
    try:
        if trace:
            timeline.write_trace(events, trace)
        if out:
            timeline.write_html(events, out, title)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"memsaver: cannot render {', '.join(events)}: {e}", file=sys.stderr)
        return 1
    for written in (trace, out):
        if written:
            print(written)
    if png and out:
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
    known = set(memsaver.stats().tags)  # memsaver's own tags (nccl) are there already
    ptrs = [
        _memsaver.malloc(sizes.get(tag, 16) * unit, 0, tag, backup)
        for tag, backup in profile.tags.items()
        if tag not in known
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
        except memsaver.MemsaverError as e:
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
        profile = memsaver.load_profile(file)
        held = memsaver.stats().total.reserved_bytes
    except memsaver.MemsaverError as e:
        print(f"memsaver: {e}", file=sys.stderr)
        return 1
    holds = (
        f"it holds {held} bytes allocated through memsaver"
        if held
        else "it holds no memory allocated through memsaver, so its pause and resume steps release nothing"
    )
    print(
        f"running stage '{stage}' of {file} in this process (pid {os.getpid()}): {holds}; its call steps are "
        "skipped (no callbacks here). To act on the processes that hold the memory, pass --pid PID or "
        "--group G.",
        file=sys.stderr,
    )
    try:
        report = profile.run(stage, skip_calls=True)
    except memsaver.MemsaverError as e:
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
    print(f"process:   this one (pid {os.getpid()}; another process's stats: --pid PID or --group G)")
    print(f"hook mode: {mode}")
    print(f"library:   {loaded[1] if loaded else '?'}")
    print(f"driver:    {os.environ.get('MEMSAVER_CUDA_LIB') or 'libcuda.so.1'}")
    print(s)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m memsaver`` and of the ``memsaver`` console script: a memsaver
    error is one line on stderr and exit status 1, not a traceback."""
    from memsaver import MemsaverError

    try:
        return _main(argv)
    except MemsaverError as e:
        print(f"{_prog()}: error: {e}", file=sys.stderr)
        return 1


def _main(argv: list[str] | None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    spec = _core_spec()
    parser = _parser(spec)
    if spec is not None:
        status = _subcommand(spec, args_list)
        if status is not None:
            return status
    if args_list and not args_list[0].startswith("-"):
        core_commands = {c["name"] for c in spec or []} - {_EXTENDED}
        python_commands = set(_subcommands(parser)) - core_commands
        # The core's commands run as given (their flags parsed by the core, `--help` too); one
        # that is not Python's while the core cannot load says why.
        if args_list[0] in core_commands or (spec is None and args_list[0] not in python_commands):
            return _core(args_list)
        if spec is None and args_list[0] == _EXTENDED:
            known, _ = parser.parse_known_args(args_list)
            if known.profile is None:
                return _core(args_list)
    args = parser.parse_args(args_list)  # exits with status 2 on an unknown command
    if args.command is None:
        parser.print_help(sys.stderr)
        print(f"{parser.prog}: error: a command is required", file=sys.stderr)
        return 2
    from memsaver import _launch

    if args.command == "demo":
        if args.profile is None:
            command = next(c for c in spec or [] if c["name"] == _EXTENDED)  # loaded: checked above
            return _core(_core_argv(args, command))
        return _demo(args.profile, args.output)
    if args.command == "timeline":
        return _timeline(args.events, args.output, args.png, args.trace, args.title)
    if args.command == "check":
        return _check(args.files)
    targeted = getattr(args, "pid", None) is not None or getattr(args, "group", None) is not None
    if getattr(args, "_target_required", False) and not targeted:
        parser.error(f"{args.command}: name the processes with --pid PID or --group G")
    if args.command in ("pause", "resume"):
        return _remote(args, args.command, tags=args.tags)
    if args.command == "run":
        if targeted:
            from memsaver import control

            return _remote(args, "run", stage=args.stage, **control._Addressed._profile(args.file))
        return _run(args.file, args.stage)
    if args.command == "stats" and targeted:
        return _remote(args, "stats")
    if args.command == "diagnostics":
        from memsaver import _diagnostics

        return _diagnostics.main()
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
