"""Every service has the same skeleton (README Layout): parts.py with a
`Parts` dataclass, `PartsDep` and `build_parts`, routes.py with a module-level `router` whose
routes take `parts: PartsDep`, an app.py that attaches the parts, and no untyped state dict.
Read from the source (ast), so nothing is imported (the engine's parts import torch)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"
SHAPED = ("rollout", "verifier", "sandbox", "engine", "learner")
ROUTE_MODULES = {
    "rollout": ("routes.py", "evaluation_routes.py", "run_routes.py"),
    "verifier": ("routes.py",),
    "sandbox": ("routes.py",),
    "engine": ("routes.py", "weight_routes.py"),
    "learner": ("routes.py",),
}


def tree(service: str, module: str) -> ast.Module:
    return ast.parse((SERVICES / service / module).read_text())


def top_level_names(module: ast.Module) -> set[str]:
    names = set()
    for node in module.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("service", SHAPED)
def test_parts_py_defines_a_parts_dataclass_its_dependency_and_build_parts(service):
    module = tree(service, "parts.py")
    assert {"Parts", "PartsDep", "build_parts"} <= top_level_names(module)
    parts = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "Parts")
    assert any("dataclass" in ast.unparse(d) for d in parts.decorator_list)


@pytest.mark.parametrize("service", SHAPED)
def test_every_route_takes_the_parts_or_nothing_of_the_app(service):
    for name in ROUTE_MODULES[service]:
        module = tree(service, name)
        assert "router" in top_level_names(module), name
        for node in module.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            routed = any("router." in ast.unparse(d) for d in node.decorator_list)
            annotations = {a.arg: ast.unparse(a.annotation) for a in node.args.args if a.annotation}
            if routed and "parts" in annotations:
                assert annotations["parts"] == "PartsDep", f"{name}:{node.name}"


@pytest.mark.parametrize("service", SHAPED)
def test_the_app_attaches_the_parts_and_no_module_keeps_a_state_dict(service):
    assert "attach(app, parts)" in (SERVICES / service / "app.py").read_text()
    state_dict = re.compile(r"\bstate\[\"|\bstate: dict|\bstate\.update\(")
    for path in (SERVICES / service).rglob("*.py"):
        assert not state_dict.search(path.read_text()), path
