"""Renders the table listing of docs/trace-format.md from collector/schema.py.

    python -m gpuprof.collector.docgen            print the generated part
    python -m gpuprof.collector.docgen --write    replace it in docs/trace-format.md
tests/test_trace_format.py fails when the doc and the schema disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpuprof.collector import schema

BEGIN = "<!-- BEGIN GENERATED FROM collector/schema.py (python -m gpuprof.collector.docgen --write) -->"
END = "<!-- END GENERATED -->"
DOC = Path(__file__).resolve().parents[1] / "docs" / "trace-format.md"


def render() -> str:
    out = [BEGIN, "", "### Root attributes", "", "| attribute | meaning |", "| --- | --- |"]
    out += [f"| `{k}` | {v} |" for k, v in schema.ROOT_ATTRS.items()]
    modes_of = {t.path: [m for m, ts in schema.MODE_TABLES.items() if t in ts] for t in schema.ALL_TABLES}
    for t in schema.ALL_TABLES:
        when = "always" if t in schema.ALWAYS else "modes: " + ", ".join(modes_of[t.path] or ["(eBPF sources)"])
        out += ["", f"### `{t.path}`", "", f"{t.doc}. Present: {when}.", "",
                "| column | type | unit | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| `{c.name}` | `{c.dtype}` | {c.unit} | {c.doc} |" for c in t.columns]
        for col, names in t.enums.items():
            shown = ", ".join(f"{i} = {n}" for i, n in enumerate(names))
            out.append("")
            out.append(f"Enum `{col}` (attribute `{col}_names` on the dataset): {shown}.")
    out += ["", END]
    return "\n".join(out)


def replace_in(text: str) -> str:
    i, j = text.index(BEGIN), text.index(END) + len(END)
    return text[:i] + render() + text[j:]


def main(argv: list[str]) -> None:
    if "--write" in argv:
        DOC.write_text(replace_in(DOC.read_text()))
    else:
        print(render())


if __name__ == "__main__":
    main(sys.argv[1:])
