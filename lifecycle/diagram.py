"""Diagrams and docs generated from `lifecycle.table`: mermaid and DOT text, a markdown reference.

`python -m lifecycle.diagram [DIR [README]]` (or `make diagrams`) rewrites the checked-in files and
the README's generated section; a test fails
when they differ from what the table generates. SVG and PNG are rendered when graphviz's `dot`
is installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from lifecycle.table import (
    FAIL_SOURCES,
    HELD_RULE,
    HOOK_RULES,
    PLANS,
    SLEEP,
    TABLE,
    Row,
    State,
    When,
    row_edges,
    rows_for,
)

_GENERATED = "generated from lifecycle/table.py by `make diagrams`; do not edit"


def guard_text(row: Row) -> str:
    """A row's condition in words: inside or outside a held scope, and its guard ("" when none)."""
    parts = {True: ["held"], False: ["not held"], None: []}[row.held]
    if row.when is not When.ALWAYS:
        parts.append(row.when.value)
    return ", ".join(parts)


def _edge_labels() -> list[tuple[State, State, str]]:
    """(source, dest, label) for every edge of every row, in table order, without repeats."""
    out: list[tuple[State, State, str]] = []

    def add(src: State, dst: State, label: str) -> None:
        if (src, dst, label) not in out:
            out.append((src, dst, label))

    for row in TABLE:
        guard = f" [{guard_text(row)}]" if guard_text(row) else ""
        deferred = " (sleep deferred)" if _defers_sleep(row) else ""
        if row.noop:
            word = _noop_word(row)
            add(row.source, row.dest, f"{row.operation}{f' ({word})' if word else ''}{guard}")
            continue
        edges = row_edges(row)
        if not edges:  # a body run in place
            body = "body, sleep deferred" if deferred else "body"
            add(row.source, row.dest, f"{row.operation} ({body}){guard}")
            continue
        for i, edge in enumerate(edges):
            plan = f" / {edge.plan.name}" if edge.plan else ""
            phase = {"move": "", "enter": "", "exit": " done"}[edge.phase]
            last = deferred if i == len(edges) - 1 else ""
            add(edge.source, edge.dest, f"{row.operation}{phase}{plan}{last}{guard}")
    for source in FAIL_SOURCES:
        if source is not State.FAILED:
            add(source, State.FAILED, "hook raised")
    return out


def _noop_word(row: Row) -> str:
    """What a row without hooks is: a hold taken or given back (""), a sleep deferred, or a no-op."""
    if row.operation in ("hold", "release"):
        return ""
    return "deferred" if row.held else "no-op"


def _defers_sleep(row: Row) -> bool:
    """A held body row that stands for a row outside the scope which sleeps after its body."""
    return bool(row.held) and any(
        r.held is False and r.when is row.when and r.exit is SLEEP
        for r in rows_for(row.operation, row.source)
    )


def mermaid() -> str:
    lines = [f"%% {_GENERATED}", "stateDiagram-v2", f"    [*] --> {State.AWAKE.value}"]
    lines += [f"    {s.value} --> {d.value}: {label}" for s, d, label in _edge_labels()]
    return "\n".join(lines) + "\n"


def dot() -> str:
    lines = [
        f"// {_GENERATED}",
        "digraph lifecycle {",
        "    rankdir=LR;",
        "    node [shape=box, style=rounded];",
    ]
    lines.append(f"    {State.FAILED.value} [color=red, fontcolor=red];")
    for s, d, label in _edge_labels():
        style = ", color=red, fontcolor=red" if d is State.FAILED else ""
        lines.append(f'    {s.value} -> {d.value} [label="{label}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _plan_cell(row: Row, which: str) -> str:
    plan = row.enter if which == "enter" else row.exit
    if which == "exit" and _defers_sleep(row):
        return f"`{SLEEP.name}` deferred"
    return f"`{plan.name}`" if plan else "—"


def reference_markdown() -> str:
    """The transition table and the plans as markdown (diagrams/transitions.md, README)."""
    out = [
        f"<!-- {_GENERATED} -->",
        "",
        "| operation | from | hooks on entering | body runs in | hooks on leaving | to | when | what |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in TABLE:
        body = (_noop_word(row) or "—") if row.noop else (row.body_state.value if row.body_state else "—")
        if row.body_context:
            body += f" (under `{row.body_context}`)"
        out.append(
            f"| `{row.operation}` | {row.source.value} | {_plan_cell(row, 'enter')} | {body} | "
            f"{_plan_cell(row, 'exit')} | {row.dest.value} | {guard_text(row) or 'always'} | {row.doc} |"
        )
    sources = ", ".join(s.value for s in FAIL_SOURCES)
    out.append(
        f"| any hook raises | {sources} | — | — | — | FAILED | always | record hooks and residency, "
        "re-raise |"
    )
    out += [
        "",
        "Plans (each step runs only when its rule holds; memory steps skip tags already in the "
        "target state; `∥` joins the hooks of one stage, which run together when the policy's "
        "`overlap_hooks` and the memory backend allow):",
        "",
    ]
    for plan in PLANS:
        steps = " → ".join(" ∥ ".join(f"`{h.value}`" for h in stage) for stage in plan.stages)
        out.append(f"- `{plan.name}`: {steps}. {plan.doc}.")
    out += ["", "Hook rules:", ""]
    out += [f"- `{hook.value}`: {rule}." for hook, rule in HOOK_RULES.items()]
    out += ["", f"Held scopes: {HELD_RULE}."]
    return "\n".join(out) + "\n"


def render(fmt: str, path: Path) -> Path:
    """Write the diagram in `fmt` ("mermaid", "dot", "svg" or "png") to `path`."""
    if fmt == "mermaid":
        path.write_text(mermaid())
    elif fmt == "dot":
        path.write_text(dot())
    elif fmt in ("svg", "png"):
        exe = shutil.which("dot")
        if exe is None:
            raise RuntimeError(
                f"rendering {fmt} needs graphviz's `dot` on PATH (apt-get install graphviz); "
                "the mermaid text needs nothing: use --format mermaid"
            )
        subprocess.run([exe, f"-T{fmt}", "-o", str(path)], input=dot(), text=True, check=True)
    else:
        raise ValueError(f"unknown diagram format {fmt!r}; use mermaid, dot, svg or png")
    return path


def readme_block() -> str:
    """The README's generated diagram section."""
    return "```mermaid\n" + mermaid().split("\n", 1)[1] + "```\n"


def update_readme(path: Path) -> bool:
    """Replace the text between the README's generated-diagram markers; True if it changed."""
    text = path.read_text()
    begin, end = "<!-- BEGIN GENERATED: diagram -->\n", "<!-- END GENERATED: diagram -->"
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no {begin.strip()} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = head + begin + readme_block() + end + tail
    path.write_text(new)
    return new != text


def write_all(directory: Path) -> list[Path]:
    """Regenerate the checked-in diagram files (and SVG/PNG when graphviz is installed)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = [
        render("mermaid", directory / "lifecycle.mmd"),
        render("dot", directory / "lifecycle.dot"),
    ]
    (directory / "transitions.md").write_text(reference_markdown())
    written.append(directory / "transitions.md")
    if shutil.which("dot"):
        written += [render("svg", directory / "lifecycle.svg"), render("png", directory / "lifecycle.png")]
    return written


if __name__ == "__main__":
    for written_path in write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "diagrams")):
        print(written_path)
    if len(sys.argv) > 2:
        update_readme(Path(sys.argv[2]))
        print(sys.argv[2])
