"""The layout shows the architecture: one import namespace (gpuprof.*), no import cycles between
the packages or inside them. Judged from the source's own import statements (module level and inside
functions alike: a lazy import is still a dependency)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"slurm_hooks": "gpuprof.slurm_hooks", "collector": "gpuprof.collector", "mpi_merge": "gpuprof.mpi_merge"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in PACKAGES.items():
        for p in (REPO / folder).rglob("*.py"):
            parts = list(p.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([name, *parts])] = p
    return mods


def _imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The project modules this file imports, and any import of a bare (un-namespaced) package."""
    found: set[str] = set()
    bare: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports the submodule when there is one
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        for n in names:
            if n.split(".")[0] in PACKAGES:
                bare.append(f"{path.relative_to(REPO)}: {n}")
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n:
                found.add(n)
    return found, bare


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps, bare = _imports(path, modules)
        assert not bare, f"imports outside the gpuprof namespace: {bare}"
        # a package's own __init__ is imported by every submodule: not an edge worth a cycle
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(_graph()) == []


def test_no_import_cycle_between_packages() -> None:
    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    pkg_graph: dict[str, set[str]] = {}
    for m, deps in _graph().items():
        pkg_graph.setdefault(package(m), set()).update(package(d) for d in deps if package(d) != package(m))
    assert _cycles(pkg_graph) == []


def test_the_analyser_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_task_prolog_and_the_compile_child_stay_light() -> None:
    """What runs inside a job's time for every task (the TaskProlog) imports no numpy, h5py or
    click; the BPF compile child's script imports nothing of the suite (it runs as a script, from
    the install's directory, with -I)."""
    import subprocess
    import sys

    code = ("import sys, gpuprof.slurm_hooks.task_prolog; "
            "print(sorted(m for m in ('numpy', 'h5py', 'click', 'bcc') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout
    compile_script = REPO / "collector" / "bpf_compile.py"
    tree = ast.parse(compile_script.read_text())
    top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    top |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "gpuprof" not in top and top <= {"array", "base64", "ctypes", "json", "os", "resource", "socket", "sys", "typing",
                                            "bcc", "__future__"}, top
