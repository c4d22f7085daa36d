"""Check that every reference in the docstrings of asymstore/ and asymcheck/ resolves.

What is checked, in every docstring (module, class, function and attribute docstrings: every bare
string statement of a module):

1. Sphinx roles ``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``, ``:exc:``, ``:data:``,
   ``:obj:``, ``:const:``. A target may carry ``~`` or ``!``, a title (``title <target>``) and a
   trailing ``()``. It is looked up as Sphinx and mkdocstrings would: in the enclosing classes, then
   the containing module, then as an absolute name; a target starting with dots is relative to the
   containing package (``.rankrestore`` beside the module, ``..x`` one package up) or, with one
   dot, to the containing module or class. ``:mod:`` must name a module.
2. ``see ``X.y```` where the head ``X`` resolves as above: then all of ``X.y`` must.
3. Paths of the repository (``docs/guides/x.md``, ``examples/y.py``, ``benches/z.py``,
   ``tests/...``, ``tools/...``, ``README.md`` ...): the file or folder must exist (globs allowed).
4. ``DESIGN §N`` / ``DESIGN.md``: always an error; the repository has no such document (point to a
   page under docs/ instead).

Names are resolved statically from the source (no package is imported, so the check is fast and
has no side effects): definitions, assignments, ``self.x`` attributes, imports (re-exports through
``__init__`` included, ``if TYPE_CHECKING:`` ones too), a module ``__getattr__`` built by
``lazy_getattr(__name__, {name: module})``, star imports and base classes. Only a name outside the
checked packages (``aiofiles.open``, ``ValueError``) is looked up by importing its module.

Usage: ``python tools/check_refs.py [--root DIR] [PACKAGE ...]`` (default: asymstore asymcheck).
Prints ``file:line: what -> why`` for each unknown reference and exits 1 when there is any.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("asymstore", "asymcheck")

ROLE = re.compile(r":(mod|func|class|meth|attr|exc|data|obj|const):`([^`]+)`")
SEE_LITERAL = re.compile(r"\b[Ss]ee\s+``([A-Za-z_][\w.]*)(?:\([^`]*\))?``")
DESIGN = re.compile(r"\bDESIGN(?:\.md)?(?:\s*§\s*\d+)?")
TOP_FILES = ("README.md", "Makefile", "pyproject.toml", "mkdocs.yml")

_TYPE_ALIAS: tuple[type, ...] = (ast.TypeAlias,) if hasattr(ast, "TypeAlias") else ()  # Python 3.12

Kind = Literal["module", "class", "function", "attribute"]


@dataclass
class Scope:
    """A module, class, function or attribute of the checked source."""

    name: str
    kind: Kind
    module: str
    members: dict[str, Scope | str] = field(default_factory=dict)  # str: an imported name, fully qualified
    bases: list[str] = field(default_factory=list)
    stars: list[str] = field(default_factory=list)
    types: list[str] = field(default_factory=list)  # an attribute's annotation: the classes it may hold


@dataclass
class Finding:
    """An unknown reference: where it is, what it says and why it does not resolve."""

    path: Path
    line: int
    what: str
    why: str

    def render(self, root: Path) -> str:
        """``file:line: what -> why``, the file relative to ``root``."""
        try:
            shown = self.path.relative_to(root)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}: {self.what} -> {self.why}"


class _External:
    """A name found outside the checked packages."""

    def __init__(self, obj: object) -> None:
        self.obj = obj

    @property
    def is_module(self) -> bool:
        return type(self.obj).__name__ == "module"


Found = Scope | _External


def _types(annotation: ast.expr | None) -> list[str]:
    """The class names an annotation names (``A | None`` -> ``["A"]``; a string annotation parsed)."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return []
    if isinstance(annotation, ast.BinOp):
        return _types(annotation.left) + _types(annotation.right)
    name = _dotted(annotation)
    return [name] if name and name != "None" else []


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    if isinstance(node, ast.Subscript):  # Generic[T], Protocol[T]
        return _dotted(node.value)
    return None


class Index:
    """Every module of the checked packages, with what each binds."""

    def __init__(self, root: Path, packages: tuple[str, ...]) -> None:
        self.root = root
        self.modules: dict[str, Scope] = {}
        self.files: dict[str, Path] = {}
        self.trees: dict[str, ast.Module] = {}
        self.sources: dict[str, str] = {}
        self._memo: dict[tuple[bool, str], Found | None] = {}
        self._active: set[tuple[bool, str]] = set()
        self.imports = False  # whether a name outside the packages may be imported to be found
        for package in packages:
            for path in sorted((root / package).rglob("*.py")):
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                name = ".".join(parts)
                source = path.read_text()
                self.files[name] = path
                self.sources[name] = source
                self.trees[name] = ast.parse(source, filename=str(path))
        for name, tree in self.trees.items():
            scope = Scope(name, "module", name)
            self._collect(scope, tree.body, name)
            self.modules[name] = scope

    def is_package(self, module: str) -> bool:
        """Whether ``module`` is a package (an ``__init__.py``)."""
        return self.files[module].name == "__init__.py"

    def package_of(self, module: str, level: int) -> str:
        """The package ``level`` dots name from ``module``, as a relative import reads them."""
        base = module if self.is_package(module) else module.rpartition(".")[0]
        for _ in range(level - 1):
            base = base.rpartition(".")[0]
        return base

    # --- collecting what a body binds -------------------------------------------------------
    def _collect(self, scope: Scope, body: list[ast.stmt], module: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                cls = Scope(f"{scope.name}.{node.name}", "class", module)
                cls.bases = [d for d in (_dotted(b) for b in node.bases) if d]
                self._collect(cls, node.body, module)
                scope.members[node.name] = cls
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                fn = Scope(f"{scope.name}.{node.name}", "function", module)
                scope.members.setdefault(node.name, fn)  # an overload or a property setter: the first one
                if scope.kind == "class":
                    self._self_attributes(scope, node, module)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                types = _types(node.annotation) if isinstance(node, ast.AnnAssign) else []
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            scope.members.setdefault(
                                name.id, Scope(f"{scope.name}.{name.id}", "attribute", module, types=types))
                if scope.kind == "module" and isinstance(node, ast.Assign):
                    self._lazy_table(scope, node, body)
            elif isinstance(node, _TYPE_ALIAS):
                name = node.name.id  # type: ignore[attr-defined]
                scope.members[name] = Scope(f"{scope.name}.{name}", "attribute", module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        scope.members[alias.asname] = alias.name
                    else:
                        head = alias.name.split(".")[0]
                        scope.members[head] = head
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = self.package_of(module, node.level)
                    source = f"{base}.{source}" if source else base
                for alias in node.names:
                    if alias.name == "*":
                        scope.stars.append(source)
                    else:
                        scope.members[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.If | ast.Try | ast.TryStar | ast.With):
                self._collect(scope, node.body, module)
                for handler in getattr(node, "handlers", []):
                    self._collect(scope, handler.body, module)
                self._collect(scope, getattr(node, "orelse", []), module)
                self._collect(scope, getattr(node, "finalbody", []), module)

    @staticmethod
    def _self_attributes(cls: Scope, fn: ast.FunctionDef | ast.AsyncFunctionDef, module: str) -> None:
        for node in ast.walk(fn):
            targets: list[ast.expr] = []
            types: list[str] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
                types = _types(node.annotation) if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    known = cls.members.get(target.attr)
                    if isinstance(known, Scope) and known.kind == "attribute":
                        known.types.extend(t for t in types if t not in known.types)
                    elif known is None:
                        cls.members[target.attr] = Scope(f"{cls.name}.{target.attr}", "attribute", module, types=types)

    @staticmethod
    def _lazy_table(scope: Scope, node: ast.Assign, body: list[ast.stmt]) -> None:
        """``__getattr__ = lazy_getattr(__name__, TABLE)``: every key of TABLE is bound to TABLE[key].key."""
        if not (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "__getattr__" and isinstance(node.value, ast.Call)
                and len(node.value.args) == 2):
            return
        table: ast.expr = node.value.args[1]
        if isinstance(table, ast.Name):
            wanted = table.id
            for other in body:
                if (isinstance(other, ast.Assign | ast.AnnAssign) and other.value is not None
                        and any(isinstance(t, ast.Name) and t.id == wanted
                                for t in (other.targets if isinstance(other, ast.Assign) else [other.target]))):
                    table = other.value
        if isinstance(table, ast.Dict):
            for key, value in zip(table.keys, table.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                    scope.members.setdefault(str(key.value), f"{value.value!s}.{key.value!s}")

    # --- resolving --------------------------------------------------------------------------
    def resolve(self, dotted: str) -> Found | None:
        """An absolute dotted name, or None."""
        key = (self.imports, dotted)
        if key in self._memo:
            return self._memo[key]
        if key in self._active:  # an import cycle of names: unresolved
            return None
        self._active.add(key)
        try:
            found = self._resolve(dotted)
        finally:
            self._active.discard(key)
        self._memo[key] = found
        return found

    def _resolve(self, dotted: str) -> Found | None:
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            if module in self.modules:
                return self._walk(self.modules[module], parts[i:])
        if parts[0] in {m.split(".")[0] for m in self.modules}:
            return None
        return _external(dotted) if self.imports else _builtin(dotted)

    def _walk(self, scope: Scope, rest: list[str]) -> Found | None:
        if not rest:
            return scope
        name, tail = rest[0], rest[1:]
        member = scope.members.get(name)
        if isinstance(member, Scope):
            return self._walk(member, tail)
        if isinstance(member, str):
            return self.resolve(".".join([member, *tail]))
        if scope.kind == "module":
            if f"{scope.name}.{name}" in self.modules:
                return self._walk(self.modules[f"{scope.name}.{name}"], tail)
            for star in scope.stars:
                found = self.resolve(".".join([star, *rest]))
                if found is not None:
                    return found
        if scope.kind == "attribute":
            for held in scope.types:
                owner = self.in_module(scope.module, held)
                found = self._walk(owner, rest) if isinstance(owner, Scope) else None
                if found is not None:
                    return found
        if scope.kind == "class":
            for base in scope.bases:
                owner = self.in_module(scope.module, base)
                if isinstance(owner, Scope):
                    found = self._walk(owner, rest)
                elif isinstance(owner, _External):
                    found = _attribute(owner.obj, rest)
                else:
                    found = None
                if found is not None:
                    return found
        return None

    def in_module(self, module: str, dotted: str) -> Found | None:
        """A name as written inside ``module``: its own names and imports, then builtins, then absolute."""
        return self.resolve(f"{module}.{dotted}") or _builtin(dotted) or self.resolve(dotted)

    def resolve_ref(self, target: str, module: str, classes: list[str]) -> Found | None:
        """A reference's target as Sphinx and mkdocstrings read it in ``module`` inside ``classes``.

        Statically first; only a target not found so is looked for again importing outside names.
        """
        for imports in (False, True):
            self.imports = imports
            found = self._resolve_ref(target, module, classes)
            if found is not None:
                return found
        return None

    def _resolve_ref(self, target: str, module: str, classes: list[str]) -> Found | None:
        if target.startswith("."):
            level = len(target) - len(target.lstrip("."))
            rest = target[level:]
            candidates = [f"{self.package_of(module, level)}.{rest}"]
            if level == 1:
                candidates += [f"{c}.{rest}" for c in classes] + [f"{module}.{rest}"]
        else:
            candidates = [f"{c}.{target}" for c in classes] + [f"{module}.{target}"]
        for candidate in candidates:
            found = self.resolve(candidate)
            if found is not None:
                return found
        if target.startswith("."):
            return None
        return _builtin(target) or self.resolve(target)


def _builtin(dotted: str) -> _External | None:
    head, _, rest = dotted.partition(".")
    if hasattr(builtins, head):
        return _attribute(getattr(builtins, head), rest.split(".") if rest else [])
    return None


def _attribute(obj: object, rest: list[str]) -> _External | None:
    for name in rest:
        if not hasattr(obj, name):
            return None
        obj = getattr(obj, name)
    return _External(obj)


def _external(dotted: str) -> _External | None:
    """A name outside the checked packages, by importing the longest module prefix that exists."""
    parts = dotted.split(".")
    try:
        if importlib.util.find_spec(parts[0]) is None:
            return _builtin(dotted)
    except (ImportError, ValueError):
        return None
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except Exception:  # any failure to import means: not this prefix
            continue
        return _attribute(module, parts[i:])
    return None


def _target(text: str) -> str:
    """The target of a role's text: no title, no ``~``/``!``, no ``()``, no whitespace."""
    match = re.fullmatch(r"(?s).*<([^<>]+)>\s*", text)
    if match:
        text = match.group(1)
    text = "".join(text.split()).lstrip("~!")
    return text.removesuffix("()")


_PATH_HEADS = ("docs", "examples", "benches", "tests", "tools", "asymstore", "asymcheck", ".ci")


def _path_pattern(root: Path, packages: tuple[str, ...]) -> re.Pattern[str]:
    heads = "|".join(re.escape(h) for h in dict.fromkeys((*_PATH_HEADS, *packages)))
    files = "|".join(re.escape(f) for f in TOP_FILES)
    return re.compile(rf"(?<![\w./:-])((?:{heads})/[\w./*-]*[\w*/]|(?:{files})\b)")


class Checker:
    """Walks every bare string of every module and checks its references."""

    def __init__(self, root: Path, packages: tuple[str, ...]) -> None:
        self.root = root
        self.index = Index(root, packages)
        self.paths = _path_pattern(root, packages)
        self.findings: list[Finding] = []

    def run(self) -> list[Finding]:
        """Every unknown reference of every module."""
        for module, tree in self.index.trees.items():
            self._visit(module, tree.body, [])
        return self.findings

    def _visit(self, module: str, body: list[ast.stmt], classes: list[str]) -> None:
        for node in body:
            if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                self._check_string(module, node.value, classes)
            elif isinstance(node, ast.ClassDef):
                scope_name = self._qualname(module, classes, node.name)
                self._visit(module, node.body, [scope_name, *classes])
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self._visit(module, node.body, classes)
            else:
                for child in ("body", "orelse", "finalbody"):
                    self._visit(module, getattr(node, child, []) or [], classes)
                for handler in getattr(node, "handlers", []):
                    self._visit(module, handler.body, classes)

    @staticmethod
    def _qualname(module: str, classes: list[str], name: str) -> str:
        return f"{classes[0]}.{name}" if classes else f"{module}.{name}"

    def _check_string(self, module: str, node: ast.Constant, classes: list[str]) -> None:
        source = ast.get_source_segment(self.index.sources[module], node) or str(node.value)
        path = self.index.files[module]

        def report(pos: int, what: str, why: str) -> None:
            self.findings.append(Finding(path, node.lineno + source.count("\n", 0, pos), what, why))

        for match in ROLE.finditer(source):
            role, target = match.group(1), _target(match.group(2))
            found = self.index.resolve_ref(target, module, classes)
            if found is None:
                report(match.start(), match.group(0), "unknown target")
            elif role == "mod" and not (found.kind == "module" if isinstance(found, Scope) else found.is_module):
                report(match.start(), match.group(0), "not a module")
        for match in SEE_LITERAL.finditer(source):
            target = match.group(1)
            head = target.split(".")[0]
            if "." in target and self.index.resolve_ref(head, module, classes) is not None:
                if self.index.resolve_ref(target, module, classes) is None:
                    report(match.start(), match.group(0), "unknown target")
        for match in DESIGN.finditer(source):
            report(match.start(), match.group(0), "no such document in the repository: point to a page under docs/")
        for match in self.paths.finditer(source):
            ref = match.group(1).rstrip(".")
            if not _exists(self.root, ref):
                report(match.start(), ref, "no such file in the repository")


def _exists(root: Path, ref: str) -> bool:
    if any(c in ref for c in "*?["):
        return any(root.glob(ref.rstrip("/")))
    return (root / ref).exists()


def check(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Finding]:
    """Every unknown reference in the docstrings of ``packages`` under ``root``."""
    return Checker(root, packages).run()


def main(argv: list[str] | None = None) -> int:
    """Run the check from the command line; 1 when anything is unknown."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    parser.add_argument("packages", nargs="*", default=list(PACKAGES), help="packages to check")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    findings = check(root, tuple(args.packages))
    for finding in findings:
        print(finding.render(root))
    print(f"{len(findings)} unknown reference(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
