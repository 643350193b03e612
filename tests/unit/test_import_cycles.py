"""No two of our modules import each other, directly or through a chain.

The graph is built from the source with `ast`, never by importing: every
`import` / `from ... import` statement anywhere in a file is an arrow, also
one inside a function or under `if TYPE_CHECKING:` (deferring an import hides
a circle from the interpreter, not from a reader). A circle is a strongly
connected component of more than one module.

How packages count:
- Every module has an arrow to its own package's `__init__`: the
  interpreter runs it before the module, whoever imports the module.
- An import of a package (`import bookie`, `from ledger_client import
  BookKeeper`) is an arrow to its `__init__` (named by the package), and, when
  the imported name is one the `__init__` re-exports, also an arrow to the
  module that defines it: `from ledger_client import LedgerHandle` depends on
  `ledger_client.ledger_handle` as surely as importing it directly. The
  re-exports followed are the `__init__`'s own `from X import name` lines and
  its `lazy_exports` map (`{"Name": "package.module"}`).
- `from package import name`, where `name` is a submodule file, is an arrow
  to that submodule.
- An `__init__`'s arrows to its own package's submodules are left out. A
  re-exporting `__init__` imports every submodule it re-exports, and they in
  turn import names from the package; counting both directions would make
  every such package one big circle without telling anything. What a
  submodule really needs is kept by the re-export rule above, so a circle
  between two submodules through their `__init__` is still found.
- Names an `__init__` maps lazily by string (`coordination/lazy_exports.py`)
  are not arrows of the `__init__` itself: nothing is imported until a name
  is used.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from quire.spark_shipping import PACKAGES  # the repository's top-level packages

REPOSITORY = Path(__file__).resolve().parents[2]

# Circles that exist today and are being removed (issue 23): each is the set
# of modules of one strongly connected component. When one is gone this test
# fails until it is taken off the list, so the list only shrinks; no circle
# may be added to it.
KNOWN_CIRCLES: list[frozenset[str]] = []


@dataclass(frozen=True)
class Arrow:
    importer: str
    imported: str
    line: int


def module_files() -> dict[str, Path]:
    """Every module of our packages by dotted name; a package's `__init__.py`
    is named by the package."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        root = REPOSITORY / package
        if not (root / "__init__.py").is_file():
            continue
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(REPOSITORY).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not (REPOSITORY.joinpath(*parts[:-1]) / "__init__.py").is_file():
                continue  # a script in a plain directory, not part of a package
            modules[".".join(parts)] = path
    return modules


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def absolute_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a `from X import ...` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package_parts = module.split(".") if is_package(path) else module.split(".")[:-1]
    base_parts = package_parts[: len(package_parts) - (node.level - 1)]
    if node.module:
        base_parts = [*base_parts, *node.module.split(".")]
    return ".".join(base_parts)


def read_source(path: Path) -> str:
    return path.read_text()


def reexports(modules: dict[str, Path], read: Callable[[Path], str]) -> dict[str, dict[str, str]]:
    """For each package `__init__`, the names it re-exports and the module
    each comes from: its `from X import name` lines and its lazy map."""
    result: dict[str, dict[str, str]] = {}
    for module, path in modules.items():
        if not is_package(path):
            continue
        names: dict[str, str] = {}
        tree = ast.parse(read(path), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = absolute_base(module, path, node)
                for alias in node.names:
                    names[alias.asname or alias.name] = base
            elif isinstance(node, ast.Dict) and node.keys and all(
                isinstance(key, ast.Constant) and isinstance(key.value, str) for key in node.keys
            ) and all(isinstance(value, ast.Constant) and isinstance(value.value, str) for value in node.values):
                # A lazy_exports map: {"Name": "package.module"}.
                for key, value in zip(node.keys, node.values):
                    if value.value.split(".")[0] in PACKAGES:
                        names[key.value] = value.value
        result[module] = names
    return result


def defining_module(package: str, name: str, exported: dict[str, dict[str, str]], modules: dict[str, Path]) -> str | None:
    """Where a name re-exported by a package `__init__` is defined, following
    re-exports through other `__init__`s."""
    seen: set[str] = set()
    while package in exported and name in exported[package] and package not in seen:
        seen.add(package)
        source = exported[package][name]
        if source not in modules:
            return None
        if source == package or not is_package(modules[source]):
            return source
        if f"{source}.{name}" in modules:
            return f"{source}.{name}"
        package = source
    return None


def arrows(modules: dict[str, Path], read: Callable[[Path], str] = read_source) -> Iterator[Arrow]:
    """Every arrow of the graph (see the module's docstring for the rules);
    line 0 is a module's arrow to its own package."""
    exported = reexports(modules, read)
    for module, path in modules.items():
        parent = module.rpartition(".")[0]
        if parent in modules:
            yield Arrow(module, parent, 0)
        tree = ast.parse(read(path), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = absolute_base(module, path, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        targets.append(submodule)
                        continue
                    targets.append(base)
                    defined_in = defining_module(base, alias.name, exported, modules)
                    if defined_in is not None:
                        targets.append(defined_in)
            for target in targets:
                if target not in modules or target == module:
                    continue
                if is_package(path) and target.startswith(module + "."):
                    continue  # an __init__ importing its own submodule: see the docstring
                yield Arrow(module, target, node.lineno)


def circles(modules: dict[str, Path], graph_arrows: list[Arrow]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    successors: dict[str, set[str]] = {module: set() for module in modules}
    for arrow in graph_arrows:
        successors[arrow.importer].add(arrow.imported)
    index_of: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[frozenset[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index_of:
            continue
        # Iterative depth-first search: (node, iterator over its successors).
        work: list[tuple[str, Iterator[str]]] = []
        index_of[root] = lowlink[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter(sorted(successors[root]))))
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index_of:
                    index_of[child] = lowlink[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(successors[child]))))
                elif child in on_stack:
                    lowlink[node] = min(lowlink[node], index_of[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index_of[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(frozenset(component))
    return components


def describe(component: frozenset[str], graph_arrows: list[Arrow], modules: dict[str, Path]) -> str:
    """The arrows inside one circle, as `importer:line -> imported`."""
    inside = {arrow for arrow in graph_arrows if arrow.importer in component and arrow.imported in component}
    lines = [
        f"  {modules[arrow.importer].relative_to(REPOSITORY)}:{arrow.line or '(its package)'} -> {arrow.imported}"
        for arrow in sorted(inside, key=lambda arrow: (arrow.importer, arrow.line, arrow.imported))
    ]
    return "circle of " + ", ".join(sorted(component)) + ":\n" + "\n".join(lines)


def test_no_module_imports_itself_through_a_chain() -> None:
    modules = module_files()
    graph_arrows = list(arrows(modules))
    found = circles(modules, graph_arrows)
    new = [component for component in found if component not in KNOWN_CIRCLES]
    assert not new, "import circles:\n" + "\n".join(describe(component, graph_arrows, modules) for component in new)


def test_known_circles_still_exist() -> None:
    """A known circle that is gone must leave KNOWN_CIRCLES, so the list
    shrinks; one that changed shape is reported as new above."""
    modules = module_files()
    found = set(circles(modules, list(arrows(modules))))
    gone = [sorted(component) for component in KNOWN_CIRCLES if component not in found]
    assert not gone, f"no longer circles, remove them from KNOWN_CIRCLES: {gone}"


def test_the_graph_sees_deferred_relative_and_reexported_imports() -> None:
    """The builder itself, on a made-up package: an import inside a
    function, one under TYPE_CHECKING, a relative one, `from package import
    submodule` and a name re-exported by the `__init__` are all arrows, and
    the circle through them is found; the `__init__`'s re-exports alone make
    no circle."""
    sources = {
        "pkg/__init__.py": "from pkg.alpha import Alpha\nfrom pkg.beta import Beta\n",
        "pkg/alpha.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import Beta\n",
        "pkg/beta.py": "def late():\n    from . import gamma\n",
        "pkg/gamma.py": "from .alpha import Alpha\n",
        "pkg/delta.py": "import pkg.alpha\n",
    }
    fake = {name: Path(f"{name.replace('.', '/')}.py") for name in ("pkg.alpha", "pkg.beta", "pkg.gamma", "pkg.delta")}
    fake["pkg"] = Path("pkg/__init__.py")
    fake_arrows = list(arrows(fake, lambda path: sources[path.as_posix()]))
    pairs = {(arrow.importer, arrow.imported) for arrow in fake_arrows}
    assert ("pkg.alpha", "pkg.beta") in pairs  # through the __init__'s re-export, under TYPE_CHECKING
    assert ("pkg.beta", "pkg.gamma") in pairs  # relative, inside a function
    assert ("pkg.gamma", "pkg.alpha") in pairs  # relative
    assert ("pkg.delta", "pkg.alpha") in pairs and ("pkg.delta", "pkg") in pairs  # plain import; its package
    assert ("pkg", "pkg.alpha") not in pairs  # __init__ -> own submodule
    assert circles(fake, fake_arrows) == [frozenset({"pkg.alpha", "pkg.beta", "pkg.gamma"})]
    # Without beta's late import the re-exporting __init__ makes no circle.
    sources["pkg/beta.py"] = "X = 1\n"
    assert circles(fake, list(arrows(fake, lambda path: sources[path.as_posix()]))) == []


def test_the_graph_covers_our_packages() -> None:
    """The real graph is there: every package present, and arrows that the
    layering says must exist."""
    modules = module_files()
    present = {module.partition(".")[0] for module in modules}
    assert present >= {"coordination", "bookie", "ledger_client", "broker", "sim", "quire", "bench"}
    pairs = {(arrow.importer, arrow.imported) for arrow in arrows(modules)}
    assert ("ledger_client.bookkeeper", "ledger_client.ledger_handle") in pairs
    assert ("bookie.server", "bookie.garbage_collector") in pairs
