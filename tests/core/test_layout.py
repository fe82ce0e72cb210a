"""The package's import rules, read from the source with ``ast`` (nothing is imported or run).

1. Ops never import each other's insides. An op package is a folder of ``jax_tk/`` with an
   ``__init__.py`` whose name does not start with ``_`` (``_core`` is the shared core, which every op
   may import freely). A module of op ``A`` reaches another op ``B`` only through ``B``'s public
   names, those in the ``__all__`` of ``jax_tk/B/__init__.py``:

   - ``from jax_tk.B import name`` with ``name`` in that ``__all__``;
   - ``from jax_tk import B`` or ``import jax_tk.B as b``, then ``B.name`` / ``b.name`` with ``name``
     in that ``__all__``; ``jax_tk.B.name`` likewise after ``import jax_tk``.

   Never a module inside ``B`` (``jax_tk.B.api``, ``jax_tk.B.launch``, ...), never a name that ``B``
   does not export, whether absolute or relative (``from ..B import x``).
2. Nothing in ``jax_tk/`` imports or reads JAX's private ``jax._src``: it changes without notice
   between the JAX versions the package supports.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jax_tk"
if not PACKAGE.is_dir():  # (tests run against an installed wheel, from a copy of tests/)
    pytest.skip("reads the package's sources: needs a source checkout", allow_module_level=True)


def _ops() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir()
                  if (p / "__init__.py").is_file() and not p.name.startswith("_"))


def _exports(op: str) -> set[str]:
    """The names in ``__all__`` of ``jax_tk/<op>/__init__.py``."""
    for node in ast.parse((PACKAGE / op / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The absolute module of ``from <module> import ...`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node) -> str | None:
    """``a.b.c`` of a Name/Attribute chain, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + names[::-1])


def _cross_op_violations(op: str, path: Path, tree: ast.AST, ops: list[str]) -> list[str]:
    others = {b: _exports(b) for b in ops if b != op}
    where = lambda node: f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
    bad = []
    aliases = {}  # local name -> what it stands for: "jax_tk" or "jax_tk.<other op>"

    def check_target(target: str, node, name: str | None = None):
        """An import of ``target`` (``jax_tk.B...``), or of ``name`` from it."""
        parts = target.split(".")
        if len(parts) < 2 or parts[0] != "jax_tk" or parts[1] not in others:
            return
        b = parts[1]
        if len(parts) > 2:
            bad.append(f"{where(node)}: imports jax_tk.{b}'s module {target} (use jax_tk.{b}'s public names)")
        elif name is not None and name not in others[b]:
            bad.append(f"{where(node)}: imports {name!r} from jax_tk.{b}, which is not in its __all__")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                check_target(a.name, node)
                if a.asname:
                    aliases[a.asname] = a.name
                elif a.name.split(".")[0] == "jax_tk":
                    aliases["jax_tk"] = "jax_tk"
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            for a in node.names:
                if module == "jax_tk" and a.name in others:  # from jax_tk import B: the package
                    aliases[a.asname or a.name] = f"jax_tk.{a.name}"
                else:
                    check_target(module, node, a.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(getattr(node, "ctx", None), ast.Store):
            continue
        chain = _dotted(node)
        if chain is None:
            continue
        head, *rest = chain.split(".")
        if head not in aliases:
            continue
        full = aliases[head].split(".") + rest
        if len(full) >= 3 and full[0] == "jax_tk" and full[1] in others and full[2] not in others[full[1]]:
            bad.append(f"{where(node)}: uses jax_tk.{full[1]}.{full[2]}, which is not in jax_tk.{full[1]}'s __all__")
    return sorted(set(bad))


def _private_jax(path: Path, tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node) or ""]
        if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: jax._src")
    return sorted(set(bad))


def test_there_are_ops():
    assert {"attention", "decode", "gemm"} <= set(_ops())


@pytest.mark.parametrize("op", _ops())
def test_ops_reach_other_ops_only_through_their_public_names(op):
    ops = _ops()
    bad = [v for path, tree in _modules(PACKAGE / op) for v in _cross_op_violations(op, path, tree, ops)]
    assert not bad, "\n".join(bad)


def test_no_private_jax():
    bad = [v for path, tree in _modules(PACKAGE) for v in _private_jax(path, tree)]
    assert not bad, "\n".join(bad)


# The rules' own checks, on snippets (so that a rule that never fires cannot pass unnoticed).
@pytest.mark.parametrize("source,violations", [
    ("from jax_tk import decode\ndecode.attention\n", 0),
    ("from jax_tk.decode import attention, update_kv_cache\n", 0),
    ("from jax_tk._core import dispatch\n", 0),
    ("from jax_tk.decode import launch\n", 1),
    ("from jax_tk.decode.api import DecodeSpec\n", 1),
    ("import jax_tk.decode.launch\n", 1),
    ("from jax_tk import decode\ndecode.launch.kernel\n", 1),
    ("import jax_tk.decode as d\nd.api\n", 1),
    ("import jax_tk\njax_tk.decode.reference\n", 1),
    ("from ..decode import launch\n", 1),
    ("from ..decode import attention\n", 0),
])
def test_the_cross_op_rule(source, violations):
    path = PACKAGE / "attention" / "example.py"
    assert len(_cross_op_violations("attention", path, ast.parse(source), ["attention", "decode", "gemm"])) == violations


@pytest.mark.parametrize("source,violations", [
    ("import jax\njax.numpy\n", 0),
    ("from jax._src import config\n", 1),
    ("import jax._src.lib\n", 1),
    ("from jax._src.cudnn import fused_attention_stablehlo\n", 1),
    ("import jax\njax._src.config\n", 1),
])
def test_the_private_jax_rule(source, violations):
    assert len(_private_jax(PACKAGE / "x.py", ast.parse(source))) == violations
