"""The shape of the code, read from the source with `ast` (nothing of nxdt is imported), beside the
layering test (tests/test_architecture.py):

- no import cycle between modules (every `import`, also the ones inside functions and under
  `if TYPE_CHECKING:`): a failure names the modules around the cycle, with the line of each import;
- imports at the top: at most 8% of the package's import statements are inside functions, and each
  of those has its reason in a comment, on its line or just above it (the entry's imports before the
  environment variables are set, an optional extra, torch-xla, ...). The comment may stand above a
  block of such imports written one after another, e.g. `try:  # optional extra: matplotlib`;
- `nxdt.config` has at most 12 modules and `nxdt.training` at most 14;
- no function longer than 100 lines, no file longer than 600.

`python tests/test_code_shape.py [PACKAGE ...] [--without PACKAGE ...]` prints the figures, for the whole
package or for some of its packages and modules (e.g. `config checkpoint tools cli.py`, or
`--without training parallel`).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "nxdt"

MAX_INSIDE_SHARE = 0.08
MAX_MODULES = {"config": 12, "training": 14}
MAX_FUNCTION_LINES = 100
MAX_FILE_LINES = 600

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
# directives, not reasons: a comment that holds only these does not say why
_DIRECTIVES = re.compile(r"(noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?|type:\s*ignore(\[[\w\-, ]+\])?|pragma:[^#]*)", re.I)


@dataclass(frozen=True)
class Import:
    module: str          # the importing module, e.g. nxdt.config.load
    path: Path
    line: int
    targets: tuple[str, ...]  # the nxdt modules it names (resolved to modules that exist)
    in_function: bool
    has_reason: bool


# --------------------------------------------------------------------------- reading the tree
def module_names(root: Path = SRC) -> dict[str, Path]:
    """module name -> file, for every .py file under `root` (the `nxdt` package folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _in_scope(name: str, packages: Iterable[str] | None, root: Path) -> bool:
    """`packages`: names under the package (`config`, `cli.py`, `models/llama.py`), or `-name` for all
    but those; None: everything."""
    if packages is None:
        return True
    rel = name.split(".")[1:]

    def under(p: str) -> bool:
        want = p.removesuffix(".py").replace("/", ".").split(".")
        return rel[:len(want)] == want

    wanted = [p for p in packages if not p.startswith("-")]
    if any(under(p[1:]) for p in packages if p.startswith("-")):
        return False
    return not wanted or any(under(p) for p in wanted)


def _comment_lines(text: str) -> dict[int, str]:
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
    return comments


def _is_reason(comment: str | None) -> bool:
    if not comment:
        return False
    words = _DIRECTIVES.sub("", comment.lstrip("#")).strip(" -:;,.")
    return any(c.isalpha() for c in words)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from pkg import submodule`
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        # a module importing its own package (or itself) is not an edge between two modules
        if name and name != module and not module.startswith(name + "."):
            found.add(name)
    return found


def imports(root: Path = SRC) -> Iterator[Import]:
    """Every import statement of the package under `root`."""
    modules = module_names(root)
    for module, path in modules.items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, str(path))
        comments = _comment_lines(text)
        yield from _imports_of(tree, module, path, modules, comments, in_function=False)


def _imports_of(node: ast.AST, module: str, path: Path, modules: dict[str, Path], comments: dict[int, str],
                in_function: bool) -> Iterator[Import]:
    block_reason = False  # a reason above the run of imports this one belongs to
    previous: ast.AST | None = None
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            own = any(_is_reason(comments.get(n)) for n in range(child.lineno, child.end_lineno + 1))
            follows = isinstance(previous, (ast.Import, ast.ImportFrom)) and previous.end_lineno == child.lineno - 1
            if not follows:
                block_reason = _is_reason(comments.get(child.lineno - 1))
            block_reason = block_reason or own
            yield Import(module, path, child.lineno,
                         tuple(sorted(_targets(child, module, path.name == "__init__.py", modules))),
                         in_function, own or block_reason)
        else:
            yield from _imports_of(child, module, path, modules, comments,
                                   in_function or isinstance(child, _FUNCTIONS))
        previous = child


# --------------------------------------------------------------------------- the checks
def cycles(root: Path = SRC) -> list[str]:
    """Each import cycle between modules, as `a (a.py:3) → b (b.py:9) → a`."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports(root):
        for target in imp.targets:
            graph.setdefault(imp.module, {}).setdefault(target, imp)
    found = []
    for component in _strongly_connected(graph):
        path = _cycle_through(min(component), graph, component)
        steps = [f"{a} ({graph[a][b].path.relative_to(root.parent)}:{graph[a][b].line})" for a, b in zip(path, path[1:])]
        found.append(" → ".join(steps + [path[-1]]))
    return sorted(found)


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(component)
    return out


def _cycle_through(start: str, graph: dict[str, dict[str, Import]], component: set[str]) -> list[str]:
    """The shortest path start → ... → start inside `component` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w not in component:
                    continue
                if w == start:
                    chain = [v]
                    while chain[-1] != start:
                        chain.append(came_from[chain[-1]])
                    return chain[::-1] + [start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a strongly connected component always has one


def import_share(root: Path = SRC, packages: Iterable[str] | None = None) -> tuple[int, int]:
    """(import statements inside functions, all import statements)."""
    found = [imp for imp in imports(root) if _in_scope(imp.module, packages, root)]
    return sum(imp.in_function for imp in found), len(found)


def imports_without_reason(root: Path = SRC, packages: Iterable[str] | None = None) -> list[str]:
    return [f"{imp.path.relative_to(root.parent)}:{imp.line}" for imp in imports(root)
            if imp.in_function and not imp.has_reason and _in_scope(imp.module, packages, root)]


def module_counts(root: Path = SRC) -> dict[str, int]:
    """Modules under each package of MAX_MODULES (its __init__ not counted, subpackages' modules counted)."""
    names = module_names(root)
    return {pkg: sum(1 for m in names if m.startswith(f"{root.name}.{pkg}.")) for pkg in MAX_MODULES}


def long_functions(root: Path = SRC, packages: Iterable[str] | None = None) -> list[str]:
    out = []
    for module, path in module_names(root).items():
        if not _in_scope(module, packages, root):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, _FUNCTIONS) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: "
                           f"{node.end_lineno - node.lineno + 1} lines")
    return out


def long_files(root: Path = SRC, packages: Iterable[str] | None = None) -> list[str]:
    out = []
    for module, path in module_names(root).items():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_FILE_LINES and _in_scope(module, packages, root):
            out.append(f"{path.relative_to(root.parent)}: {n} lines")
    return out


# --------------------------------------------------------------------------- tests
def test_no_import_cycle_between_modules():
    found = cycles()
    assert not found, "import cycles (move the shared piece to the module that owns it):\n" + "\n".join(found)


def test_imports_are_at_the_top():
    inside, total = import_share()
    assert inside <= MAX_INSIDE_SHARE * total, (
        f"{inside} of {total} import statements ({inside / total:.1%}) are inside functions; at most "
        f"{MAX_INSIDE_SHARE:.0%}: move them to the module's top")


def test_every_import_inside_a_function_says_why():
    missing = imports_without_reason()
    assert not missing, ("imports inside a function without a comment giving the reason (on the line or just "
                         "above; or move it to the top):\n" + "\n".join(missing))


def test_packages_stay_small():
    counts = module_counts()
    over = {pkg: n for pkg, n in counts.items() if n > MAX_MODULES[pkg]}
    assert not over, f"modules per package {over}, at most {MAX_MODULES}"


def test_no_long_function_and_no_long_file():
    found = long_functions() + long_files()
    assert not found, (f"functions over {MAX_FUNCTION_LINES} lines, files over {MAX_FILE_LINES}:\n"
                       + "\n".join(found))


def test_the_checker_sees_a_cycle_and_an_import_without_reason(tmp_path):
    """The checks have teeth: a cycle hidden in a function is reported with each import's line, and so
    is a function-level import without a comment; a commented one passes."""
    fake = tmp_path / "nxdt"
    (fake / "pkg").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "pkg" / "__init__.py").write_text("")
    (fake / "pkg" / "a.py").write_text("import os\n\nfrom nxdt.pkg import b\n")
    (fake / "pkg" / "b.py").write_text("def f():\n    from nxdt.pkg.a import x\n\n\n"
                                       "def g():\n    # optional extra: wandb\n    import wandb\n")
    assert cycles(fake) == ["nxdt.pkg.a (nxdt/pkg/a.py:3) → nxdt.pkg.b (nxdt/pkg/b.py:2) → nxdt.pkg.a"]
    assert imports_without_reason(fake) == ["nxdt/pkg/b.py:2"]
    assert import_share(fake) == (2, 4)


def _report(packages: list[str] | None) -> None:
    inside, total = import_share(packages=packages)
    where = "nxdt" + (" " + " ".join(p.replace("-", "without ", 1) if p.startswith("-") else p for p in packages)
                      if packages else "")
    print(f"{where}: {inside} of {total} import statements inside functions = {inside / max(total, 1):.1%} "
          f"(at most {MAX_INSIDE_SHARE:.0%})")
    print("without a reason:", imports_without_reason(packages=packages) or "none")
    print("import cycles (whole package):", cycles() or "none")
    print("modules:", module_counts(), "at most", MAX_MODULES)
    print(f"functions over {MAX_FUNCTION_LINES} lines:", long_functions(packages=packages) or "none")
    print(f"files over {MAX_FILE_LINES} lines:", long_files(packages=packages) or "none")


if __name__ == "__main__":
    args, without = sys.argv[1:], False
    chosen = []
    for arg in args:
        if arg == "--without":
            without = True
        else:
            chosen.append("-" + arg if without else arg)
    _report(chosen or None)
