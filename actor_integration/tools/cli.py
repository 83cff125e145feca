"""The `lifecycle` command: demo, check, timeline, gather, diagram, doctor.

Each subcommand imports what it needs when it runs, so `lifecycle check` and `lifecycle diagram`
start without torch or Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn


def _diagram(args: argparse.Namespace) -> int:
    from lifecycle import diagram

    if args.output is None:
        if args.format not in ("mermaid", "dot"):
            args.parser.error(f"--format {args.format} writes a binary file: give -o FILE")
        sys.stdout.write(diagram.mermaid() if args.format == "mermaid" else diagram.dot())
        return 0
    try:
        diagram.render(args.format, Path(args.output))
    except (RuntimeError, OSError) as exc:
        args.parser.error(str(exc))
    print(args.output)
    return 0


def _check(args: argparse.Namespace) -> int:
    from lifecycle import checker, logs

    try:
        files = logs.read_logs(args.logs)
        run = checker.LogChecker()
        for file in files:
            run.feed_lines(file.path, file.lines)
        findings = run.finish()
    except (OSError, ValueError) as exc:
        args.parser.error(str(exc))
    for finding in findings:
        print(finding)
    ended_failed = run.ended_failed()
    died = run.engines_died()
    for line in ended_failed + died:
        print(line)
    verdict = "clean" if not findings else f"{len(findings)} finding(s)"
    failed = f"; {len(ended_failed)} ended FAILED" if ended_failed else ""
    failed += f"; {len(died)} engine(s) died" if died else ""
    print(
        f"lifecycle check: {len(files)} file(s), {run.events} event(s), {run.machines} machine(s): {verdict}{failed}",
        file=sys.stderr,
    )
    return 0 if not findings else 1


def _timeline(args: argparse.Namespace) -> int:
    from lifecycle import timeline

    out = Path(args.output)
    stem = out.with_suffix("") if out.suffix in (".json", ".png") else out
    trace, png = stem.with_suffix(".json"), stem.with_suffix(".png")
    try:
        lanes = timeline.read_lanes(args.logs)  # read once for the trace and the picture
    except (OSError, ValueError) as exc:
        args.parser.error(str(exc))
    try:
        timeline.write_trace(lanes, trace)
        print(f"{trace}  (open in https://ui.perfetto.dev or chrome://tracing)")
        if not args.no_png:
            picture = timeline.render_png(lanes, png)
            print(f"{png}  ({len(picture.lanes)} lane(s), {picture.seconds:.1f} s)")
    except OSError as exc:
        args.parser.error(f"-o {args.output}: cannot write {exc.filename or stem} ({exc.strerror or exc})")
    except ValueError as exc:
        args.parser.error(str(exc))
    for problem in timeline.problems(lanes):
        print(f"lifecycle timeline: {problem} (skipped; the rest is drawn)", file=sys.stderr)
    return 0


def _gather(args: argparse.Namespace) -> int:
    import logging

    import ray

    from actor_integration.actors.cluster import describe_cluster, gather_logs
    from actor_integration.tools.doctor import unreachable

    problem = unreachable(args.address, min(args.timeout_s, 10.0))  # Ray retries an absent GCS for minutes
    if problem is not None:
        args.parser.error(f"--address {args.address}: {problem}")
    try:
        ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError as exc:  # "auto" with no cluster on this host: Ray's own words, one line
        args.parser.error(f"--address {args.address}: {str(exc).splitlines()[0]}")
    try:
        print(f"joined Ray cluster at {args.address}: {describe_cluster()}", file=sys.stderr)
        gathered = gather_logs(args.output, directory=args.dir, timeout_s=args.timeout_s)
    finally:
        ray.shutdown()
    print(gathered)
    if gathered.files:
        print(
            f"next: lifecycle check {args.output}   lifecycle timeline {args.output} -o timeline",
            file=sys.stderr,
        )
    return 0 if gathered.files and not gathered.unread else 1


def _doctor(args: argparse.Namespace) -> int:
    from actor_integration.tools import doctor

    report = doctor.run_checks(
        ray_address=args.address, cuda_graphs=args.cuda_graphs, transport=args.transport
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        doctor.render(report)
    return 0 if report["ok"] else 1


def _demo(args: argparse.Namespace) -> int:
    from actor_integration.tools.demo.options import check_address, check_demo_arguments, refuse

    problem = check_demo_arguments(args)
    if problem is not None:
        refuse(problem)
    if args.address:
        check_address(args.address, args.timeout_s)  # Ray itself retries an unreachable GCS for minutes
    from actor_integration.tools.demo.driver import run_demo

    return run_demo(args)


class _Parser(argparse.ArgumentParser):
    """argparse, with abbreviations off (`--engine` is not `--engines`) and errors on one line:
    `lifecycle demo: error: argument --steps: ...`, exit code 2, as the demo's own checks answer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from lifecycle import __version__

    parser = _Parser(prog="lifecycle", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"lifecycle (rl-lifecycle) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser(
        "demo", help="run a colocated RL loop on Ray (trainer + rollout on the same devices)"
    )
    from actor_integration.tools.demo.options import add_demo_arguments

    add_demo_arguments(demo)
    demo.set_defaults(func=_demo, parser=demo)

    check = sub.add_parser("check", help="replay lifecycle logs against the transition table")
    check.add_argument("logs", nargs="+", help="per-rank JSON-lines lifecycle logs")
    check.set_defaults(func=_check, parser=check)

    timeline = sub.add_parser("timeline", help="draw what every rank did: Perfetto trace + PNG")
    timeline.add_argument("logs", nargs="+", help="per-rank JSON-lines lifecycle logs")
    timeline.add_argument(
        "-o", "--output", required=True, help="output path (FILE.json and FILE.png are written)"
    )
    timeline.add_argument("--no-png", action="store_true", help="write only the trace")
    timeline.set_defaults(func=_timeline, parser=timeline)

    gather = sub.add_parser(
        "gather",
        help="collect every node's per-rank logs through Ray into one directory (for check, timeline)",
    )
    gather.add_argument(
        "--address",
        default="auto",
        help="Ray cluster to collect from (default: auto, the cluster on this host)",
    )
    gather.add_argument(
        "--dir",
        default=None,
        help="where the ranks wrote on their nodes (default: each node's $RL_LIFECYCLE_LOG_DIR, else ./lifecycle-logs)",
    )
    gather.add_argument("-o", "--output", required=True, help="directory on this host to copy the logs into")
    gather.add_argument(
        "--timeout-s", type=float, default=60.0, help="deadline for the nodes' answers (seconds)"
    )
    gather.set_defaults(func=_gather, parser=gather)

    diagram = sub.add_parser("diagram", help="write the state diagram generated from the transition table")
    diagram.add_argument("--format", choices=["mermaid", "dot", "svg", "png"], default="mermaid")
    diagram.add_argument("-o", "--output", help="file to write (default: mermaid/dot text on stdout)")
    diagram.set_defaults(func=_diagram, parser=diagram)

    doctor = sub.add_parser("doctor", help="check this environment before a colocated job")
    doctor.add_argument("--address", help="Ray cluster address to check (default: RAY_ADDRESS)")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether a process captures CUDA graphs (SGLang does unless --disable-cuda-graph)",
    )
    doctor.add_argument(
        "--transport",
        choices=["auto", "cuda_ipc", "shm", "disk", "nccl"],
        default=None,
        help="the weight transport the job will use (default: the one doctor recommends)",
    )
    doctor.set_defaults(func=_doctor, parser=doctor)
    return parser


# The bare install is the core alone; a subcommand that needs more names the extra that brings it.
EXTRA_FOR_MODULE = {
    "torch": "torch",
    "torch_memory_saver": "torch",
    "numpy": "torch",
    "psutil": "torch",
    "ray": "ray",
    "matplotlib": "plots",
    "rich": "demo",
    "megatron": "megatron",
    "sglang": "sglang",
}


def missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """The one-line answer to a subcommand that needs a module the install left out, or None."""
    module = (exc.name or "").partition(".")[0]
    extra = EXTRA_FOR_MODULE.get(module)
    if extra is None:
        return None
    if command in ("demo", "doctor"):
        extra = "demo"  # torch, Ray, matplotlib and rich together
    hint = " (or --no-png for the trace alone)" if command == "timeline" and extra == "plots" else ""
    return f"needs {module}, which this install leaves out: pip install 'rl-lifecycle[{extra}]'{hint}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand that was given them, as argparse says everything else
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code: int = args.func(args)
    except ModuleNotFoundError as exc:
        problem = missing_extra(args.command, exc)
        if problem is None:
            raise
        args.parser.error(problem)
    return code


if __name__ == "__main__":
    sys.exit(main())
