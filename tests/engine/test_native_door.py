"""engine/native.py is the engine's one door to the native executor (issue 54): it is engine/'s only import
of `kernels/` and the only engine module that names the model's executor; the others (and the server) call
its functions with the model and never hold the executor object. Read from the source, plus the
pass-throughs' calls checked against a recording stand-in for the executor (no native build needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tinyloop
from tinyloop.engine import native

SRC = Path(tinyloop.__file__).parent
DOOR = SRC / "engine" / "native.py"
GUARDED = sorted((SRC / "engine").rglob("*.py")) + sorted((SRC / "server").rglob("*.py"))


def _where(path: Path, node: ast.AST) -> str:
    name = path.relative_to(SRC.parent) if path.is_relative_to(SRC.parent) else path.name
    return f"{name}:{node.lineno}"


def _executor_uses(path: Path) -> list[str]:
    """`x.executor`, getattr/setattr/hasattr/delattr(x, "executor"), and calls of a `native(...)` (the old door
    that handed the executor out) in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "executor":
            found.append(f"{_where(path, node)} .executor")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value == "executor":
                found.append(f"{_where(path, node)} {name}(..., 'executor')")
            elif name == "native":
                found.append(f"{_where(path, node)} native(...)")
    return found


def _kernels_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] + [f"{module}.{a.name}" for a in node.names]
            if any(n == "kernels" or n.startswith("kernels.") or ".kernels" in f".{n}" for n in names):
                found.append(f"{_where(path, node)} from {'.' * node.level}{module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{_where(path, node)} import {a.name}" for a in node.names if "kernels" in a.name.split(".")]
    return found


def test_only_the_door_names_the_executor():
    found = [use for path in GUARDED if path != DOOR for use in _executor_uses(path)]
    assert not found, "reach the native executor through engine/native.py's functions, not directly: " \
        + "; ".join(found)


def _fast_executor_imports(path: Path) -> list[str]:
    """Imports of model.fast's executor functions (who runs the model, attaching the executor): the door's too."""
    wanted = {"executor_name", "prepare_for_decode", "attach_executor"}
    return [f"{_where(path, node)} {a.name}" for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("fast")
            for a in node.names if a.name in wanted]


def test_only_the_door_attaches_and_names_the_executor():
    found = [use for path in GUARDED if path != DOOR for use in _fast_executor_imports(path)]
    assert not found, "use engine/native.py's attach and name: " + "; ".join(found)
    assert _fast_executor_imports(DOOR), "the check above reads imports it can no longer see"


def test_the_door_is_engines_only_import_of_kernels():
    found = [use for path in sorted((SRC / "engine").rglob("*.py")) if path != DOOR for use in _kernels_imports(path)]
    assert not found, found
    assert _kernels_imports(DOOR), "the check above reads imports it can no longer see"


def test_the_door_never_hands_the_executor_out():
    """No function of engine/native.py returns the executor itself (or a bare getattr of it)."""
    found = []
    for node in ast.walk(ast.parse(DOOR.read_text(), str(DOOR))):
        if isinstance(node, ast.Return) and node.value is not None:
            v = node.value
            if (isinstance(v, ast.Attribute) and v.attr == "executor") or (
                    isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "getattr"
                    and len(v.args) > 1 and isinstance(v.args[1], ast.Constant) and v.args[1].value == "executor"):
                found.append(_where(DOOR, node))
    assert not found, found


def test_the_check_sees_a_direct_use(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(model):\n    ex = native(model)\n"
                   "    return model.executor.run(), getattr(model, 'executor')\n")
    assert len(_executor_uses(bad)) == 3
    imp = tmp_path / "imp.py"
    imp.write_text("from ..kernels.lib import loaded\nfrom .. import kernels\nimport tinyloop.kernels.executor\n")
    assert len(_kernels_imports(imp)) == 3


class _Recorder:
    """Stands in for `NativeExecutor`: records each call, returns a token naming it."""

    streamed = True

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kw):
            self.calls.append((name, args, kw))
            return ("result", name)
        return call


class _Model:
    def __init__(self, executor):
        self.executor = executor


PASS_THROUGHS = [   # (door function, executor method, positional args after the model, keyword args): the
    ("supports", "supports", ("rows",), {}),                     # executor gets them as given
    ("generate", "generate", tuple(range(11)), {}),
    ("spec_round", "spec_round", tuple(range(13)),
     dict(want_state=False, pipeline=True, noise=(1,), ahead=3, head_rows=4, rounds=2, stop=(7,))),
    ("tree_round", "tree_round", tuple(range(14)), dict(noise=(1,), head_rows=3)),
    ("head_costs", "head_costs", (5,), {}),
    ("head_argmax", "argmax", ("x", [None]), {}),
    ("project", "project", ("x", "w"), {}),
]


@pytest.mark.parametrize("door,method,args,kw", PASS_THROUGHS, ids=[p[0] for p in PASS_THROUGHS])
def test_each_pass_through_calls_the_executor_as_given(door, method, args, kw):
    ex = _Recorder()
    assert getattr(native, door)(_Model(ex), *args, **kw) == ("result", method)
    assert ex.calls == [(method, args, kw)]


def test_defaults_reach_the_executor():
    ex = _Recorder()
    native.generate(_Model(ex), *range(10))
    native.spec_round(_Model(ex), *range(13))
    native.tree_round(_Model(ex), *range(14))
    native.head_argmax(_Model(ex), "x")
    native.head_costs(_Model(ex))
    assert [c[0] for c in ex.calls] == ["generate", "spec_round", "tree_round", "argmax", "head_costs"]
    assert ex.calls[0][1][-1] is None                      # grammar
    assert ex.calls[1][2] == dict(want_state=True, pipeline=False, noise=None, ahead=0, head_rows=2, rounds=1, stop=())
    assert ex.calls[2][2] == dict(noise=None, head_rows=2)
    assert ex.calls[3][1] == ("x", None)
    assert ex.calls[4][1] == (9,)


def test_runs_natively_and_streamed():
    assert not native.runs_natively(_Model(None)) and not native.runs_natively(object())
    model = _Model(_Recorder())
    assert native.runs_natively(model) and native.streamed(model) is True
    native.detach(model)
    assert model.executor is None and not native.runs_natively(model)


WORK = {"supports", "generate", "spec_round", "tree_round", "head_costs", "head_argmax", "project", "kept_round_costs",
        "keep_round_costs"}
RUNNER = SRC / "engine" / "batch.py"


def _work_calls(path: Path) -> list[str]:
    """Uses of the door's work functions in one file: `native.<work>` (the module imported under any name that
    ends in native) and `from ...native import <work>`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in WORK and isinstance(node.value, ast.Name) \
                and node.value.id.endswith("native"):
            found.append(f"{_where(path, node)} {node.value.id}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "native":
            found += [f"{_where(path, node)} import {a.name}" for a in node.names if a.name in WORK]
    return found


def test_only_the_batch_runner_runs_native_work():
    """One runner: the step's rows, whole rounds, a lone sequence's calls, the head's picks, draft logits and the
    head's costs all run in `BatchRunner`; the other engine and server modules hand it work."""
    found = [use for path in GUARDED if path not in (DOOR, RUNNER) for use in _work_calls(path)]
    assert not found, "hand native work to engine/batch.py's BatchRunner: " + "; ".join(found)
    assert _work_calls(RUNNER), "the check above reads calls it can no longer see"


def test_the_runner_check_sees_a_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from .native import generate, name\nfrom . import native\n"
                   "def f(m):\n    return native.spec_round(m), native.name(m)\n")
    assert len(_work_calls(bad)) == 2


def _door_imports(path: Path) -> list[tuple[str, str]]:
    """(where, name) of each import of engine/native.py in one file, relative or absolute (`from . import native`,
    `from .native import x`, `from ..engine import native`, `import tinyloop.engine.native`); the name is what is
    imported from the door, or "native" for the module itself. Not server/native (the native API's routes)."""
    pkg = list(path.relative_to(SRC.parent).parent.parts) if path.is_relative_to(SRC.parent) else ["tinyloop", "engine"]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            for a in node.names:
                if module == ["tinyloop", "engine", "native"]:
                    found.append((_where(path, node), a.name))
                elif module + [a.name] == ["tinyloop", "engine", "native"]:
                    found.append((_where(path, node), "native"))
        elif isinstance(node, ast.Import):
            found += [(_where(path, node), "native") for a in node.names if a.name == "tinyloop.engine.native"]
    return found


def test_only_the_runner_imports_the_door():
    """The runner alone imports the door (native work, how native code runs the model, the executor's life as its
    static methods, the library's row draw); every other module of the package asks the runner, or the Engine,
    which asks the runner."""
    found = [f"{where} {name}" for path in sorted(SRC.rglob("*.py")) if path not in (DOOR, RUNNER)
             for where, name in _door_imports(path)]
    assert not found, "ask engine/batch.py's BatchRunner (or the Engine), not engine/native.py: " + "; ".join(found)
    assert _door_imports(RUNNER), "the check above reads imports it can no longer see"


def test_the_importer_check_sees_each_form(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from .native import runs_natively, streamed\nfrom . import native\n"
                   "from ..engine import native as door\nimport tinyloop.engine.native\n"
                   "from .native_rounds import NativeRound\nfrom ..server.native import routes\n")
    assert [name for _, name in _door_imports(bad)] == ["runs_natively", "streamed", "native", "native", "native"]
