"""The layering rules of docs/design.md, read off the source (no GPU, no import): an op module uses
no private name of another op module, and no module but cupyquant/_device.py compares compute
capabilities (the others ask it what a GPU offers: ``_device.caps(device).wgmma``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cupyquant"
#: The op modules and packages: the public op families, each a module or a package of its own.
OP_MODULES = ("per_tensor", "groupwise", "mx", "nvfp4", "norm", "kv_cache", "quantized", "weight", "w8a8")


def _sources(*dirs):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_name_uses(rel: Path, text: str) -> list:
    """Where the cupyquant file ``rel`` (relative to the package) uses a private name of an op
    module other than its own: ``from .mx import _helper``, or ``groupwise._layout`` after
    ``from . import groupwise``."""
    own = rel.parts[0].removesuffix(".py")
    own = own if own in OP_MODULES else None
    pkg = rel.parts[:-1]  # the file's package, as parts below cupyquant
    tree = ast.parse(text)
    found, modules = [], {}  # local name -> the op module it names
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = pkg[: len(pkg) - (node.level - 1)] + (tuple(node.module.split(".")) if node.module else ())
        for alias in node.names:
            full = base + (alias.name,)
            if full[0] not in OP_MODULES or full[0] == own:
                continue
            if len(full) == 1 or (len(full) == 2 and full[0] in ("weight", "w8a8") and not base[1:]):
                modules[alias.asname or alias.name] = full[0]  # the op module (or a submodule) itself
            elif _private(alias.name):
                found.append(f"{rel}:{node.lineno} imports {'.'.join(full)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if _private(node.attr):
                found.append(f"{rel}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


def _is_capability(node) -> bool:
    """A compute capability value: ``x.compute_capability``, ``_device.arch(d)``, a name ``arch`` or
    ``..._ARCHS``, or ``int()`` of one of those."""
    if isinstance(node, ast.Attribute):
        return node.attr == "compute_capability" or node.attr.endswith("_ARCHS")
    if isinstance(node, ast.Name):
        return node.id == "arch" or node.id.endswith("_ARCHS")
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "arch":
            return True
        if isinstance(f, ast.Name) and f.id == "int" and node.args:
            return _is_capability(node.args[0])
    return False


def _is_literal(node) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_literal(e) for e in node.elts)
    return isinstance(node, ast.Constant) and node.value is not None or _is_capability(node)


def capability_compares(text: str) -> list:
    """Comparisons of a compute capability with a value (``arch == "90"``, ``int(arch) >= 90``,
    ``arch in SM90_ARCHS``), and reads of ``compute_capability``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare) and not any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(_is_capability(o) for o in operands) and sum(_is_literal(o) for o in operands) >= 2:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr == "compute_capability":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_op_module_uses_another_op_modules_private_names():
    found = []
    for path in _sources("cupyquant"):
        found += private_name_uses(path.relative_to(PACKAGE), path.read_text())
    assert not found, "\n".join(found)


def test_the_private_name_rule_catches_imports_and_attributes():
    text = "from . import groupwise\nfrom .mx import _helper\nfrom ._scales import _ok\nx = groupwise._layout\n"
    text += "y = groupwise.scheme\n"
    found = private_name_uses(Path("norm.py"), text)
    assert found == ["norm.py:2 imports mx._helper", "norm.py:4 uses groupwise._layout"], found
    inside = "from .dispatch import _forced_path\nfrom ..weight import layout\nz = layout._pad_rows\n"
    assert private_name_uses(Path("weight/__init__.py"), inside) == []
    assert private_name_uses(Path("w8a8/operands.py"), inside.split("\n", 1)[1]) == [
        "w8a8/operands.py:2 uses layout._pad_rows"
    ]


#: Where reading a compute capability is the point: the module that owns the facts, the test gate
#: (which touches the driver through it), and the script that labels its compile-time table.
_CAPABILITY_HOMES = {PACKAGE / "_device.py", ROOT / "tests" / "conftest.py", ROOT / "scripts" / "compile_time.py"}


def test_only_device_compares_compute_capabilities():
    found = []
    for path in _sources("cupyquant", "tests", "scripts"):
        if path not in _CAPABILITY_HOMES and path != Path(__file__).resolve():
            found += [f"{path.relative_to(ROOT)}:{hit}" for hit in capability_compares(path.read_text())]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "src,caught",
    [
        ("ok = arch in ('90',)", True),
        ("ok = int(_device.arch(d)) >= 90", True),
        ("ok = cupy.cuda.Device().compute_capability", True),
        ("ok = _device.caps(d).wgmma", False),
        ("ok = n >= 90", False),
        ("ok = arch is None", False),
        ("ok = matmul_path(1, w, arch='90') == 'decode'", False),
        ("ok = '-arch=sm_90' in options", False),
    ],
)
def test_the_capability_rule_itself(src, caught):
    assert bool(capability_compares(src)) == caught, src
