"""The package's import graph (every import statement, module level or inside a function):
no circles, and the lower layers (config, runs, data, models, privacy, features) never import the upper
ones (train, tune, cli). Found by parsing the sources, so nothing is imported to check it."""

import ast
from pathlib import Path
from dpscale.privacy.plan.numbers import PrivacyNumbers

SRC = Path(__file__).resolve().parents[1] / "src"
LOWER = (
    "dpscale.config",
    "dpscale.runs",
    "dpscale.data",
    "dpscale.models",
    "dpscale.privacy",
    "dpscale.features",
)
UPPER = ("dpscale.train", "dpscale.tune", "dpscale.cli", "dpscale.audit")


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The package modules an import statement loads (``from a import b``: a, and a.b if a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    return {name for name in names if name in modules and name != module}


def _runtime_imports(tree: ast.AST) -> list[ast.AST]:
    """The import statements that run: all but those under ``if TYPE_CHECKING:`` (types for checkers
    only, which make no circle at run time)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = set().union(
            *(_targets(module, path, n, modules) for n in _runtime_imports(tree))
        )
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_circles():
    assert _cycles(import_graph()) == []


def _within(module: str, packages: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``packages`` or inside one (dpscale.clip_norms is not in dpscale.cli)."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_within_matches_whole_package_names():
    assert _within("dpscale.cli.train", UPPER) and _within("dpscale.cli", UPPER)
    assert not _within("dpscale.clip_norms", UPPER)


def test_lower_layers_never_import_train_tune_or_cli():
    upward = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if _within(module, LOWER)
        for target in sorted(targets)
        if _within(target, UPPER)
    ]
    assert upward == []


def test_the_checker_sees_circles_and_upward_imports():
    # the checks above would pass on an empty graph: show they find what they look for
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    # local and module-level imports
    assert "dpscale.privacy.clipping.ghost.engine" in graph["dpscale.privacy.clipping.engines"]
    assert "dpscale.train.loop" in graph["dpscale.train.run"]  # a function-level import is seen


def test_importing_the_privacy_package_does_not_load_the_model_zoo():
    import subprocess
    import sys

    code = "import sys, dpscale.privacy; print(sorted(m for m in sys.modules if m.startswith('dpscale.models')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def _code_lines(node: ast.AST) -> int:
    """A function's body lines, its signature and docstring aside (make_private documents 36
    keyword arguments, one per line as the formatter writes them)."""
    body = node.body
    first = body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        body = body[1:]
    return 0 if not body else node.end_lineno - body[0].lineno + 1


def test_the_training_package_has_no_module_over_400_lines_and_no_function_over_50():
    modules = sorted((SRC / "dpscale" / "train").glob("*.py"))
    assert len(modules) > 5  # the check looks where the code is
    too_big = [
        f"{path.name}: {len(path.read_text().splitlines())} lines"
        for path in modules
        if len(path.read_text().splitlines()) > 400
    ]
    too_long = [
        f"{path.name}:{node.name}: {_code_lines(node)} lines"
        for path in modules
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > 50
    ]
    assert too_big == [] and too_long == []
    assert (
        _code_lines(
            ast.parse(
                'def f(\n    a,\n):\n    """doc\n    more"""\n    b = a\n    return b\n'
            ).body[0]
        )
        == 2
    )


def test_the_privacy_core_does_not_depend_on_the_config():
    graph = import_graph()
    config_modules = {m for m in graph if m == "dpscale.config" or m.startswith("dpscale.config.")}
    assert len(config_modules) >= 5  # the package and its modules
    assert [
        m for m in graph if m.startswith("dpscale.privacy") and config_modules & set(graph[m])
    ] == []


def test_the_plan_from_plain_numbers_equals_the_plan_from_a_config():
    from dpscale.config import DPConfig
    from dpscale.privacy.plan.make_plan import make_dp_plan
    from dpscale.train.plan_config import plan_from_config

    dp = DPConfig(
        epsilon=2.0,
        delta=1e-5,
        batch_size=256,
        max_grad_norm=0.7,
        accountant="rdp",
        simulated_batch_size=128,
    )
    from_numbers = make_dp_plan(
        PrivacyNumbers(
            batch_size=256,
            max_grad_norm=0.7,
            delta=1e-5,
            target_epsilon=2.0,
            simulated_batch_size=128,
            accountant="rdp",
        ),
        dataset_size=60_000,
        steps=500,
    )
    assert from_numbers == plan_from_config(dp, 60_000, 500)
    assert from_numbers.simulation is not None and from_numbers.batch_size == 128


def test_loading_a_config_does_not_import_torch():
    """The config validates dp.max_grad_norm (per-layer too) without the privacy core's torch."""
    import subprocess
    import sys

    code = "import sys, dpscale.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dpscale_account_does_not_import_torch():
    """``dpscale account`` answers in under 2 s on 2 cores (docs/benchmarks.md) because it never
    loads torch (1.4 s of imports): the parser, the DP plan and the accountant are torch-free."""
    import subprocess
    import sys

    code = (
        "import sys; from dpscale.cli import main; "
        "assert main(['account', '--dataset-size', '60000', '--batch-size', '256', '--noise', '1.1', "
        "'--epochs', '1', '--json']) == 0; "
        "assert main(['account', '--dataset-size', '60000', '--batch-size', '256', '--noise', '1.1', '--epochs', '1', "
        "'--data-norm-noise', '8', '--feature-mean-noise', '8', '--json']) == 0; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# Private names read on another object, by design: dpscale's own private modules, third-party internals
# each documented at its use (dp_accounting's PMF arrays, torch's version counters and foreach kernels, ...),
# and the guard flags the mechanism sets on the user's optimizer.
_PRIVATE_BY_DESIGN = {
    "dpscale._io",
    "dpscale._version",
    "dpscale._lazy",
    "numpy._core",
    "torch._foreach_add",
    "torch._foreach_add_",
    "torch._foreach_sub_",
    "torch._foreach_mul",
    "torch._foreach_mul_",
    "torch._foreach_div",
    "torch._foreach_div_",
    "torch._dynamo",
    "torch._inductor",  # bench/ops: inductor's cpp kernels recorded by the profiler (cpp.enable_kernel_profile)
    "onnx._internal",
    "exporter._registration",
    "privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss",  # pld_gaussian, with a fallback
    "privacy_loss_distribution._pld_for_subsampled_mechanism",
    "pld._pmf_remove",
    "pld._pmf_add",
    "pld._symmetric",
    "probe._pmf_remove",
    "probe._pmf_add",
    "dense._probs",
    "dense._lower_loss",
    "dense._infinity_mass",
    "dense._discretization",
    "t._base",
    "output._version",
    "inputs._version",
    "model._modules",
    "base._conv_forward",
    "optimizer._dpscale_in_step",
    "optimizer._dpscale_guarded",
    "optimizer._is_last_step_skipped",  # the last: Opacus (bench)
}


def test_no_module_reaches_into_another_objects_private_members_and_no_trainer_is_any():
    """Issue 46: seams are public (``mechanism.step_drawn_chunks``, ``trainer.last_stats``), and the
    helper modules type the Trainer they take instead of ``Trainer = Any``."""
    import re

    pattern = re.compile(r"(?<![\w.])(?!self\b|cls\b)([a-z_][a-z0-9_]*\._[a-z][a-z0-9_]*)")
    found = []
    for path in (SRC / "dpscale").rglob("*.py"):
        text = path.read_text()
        if re.search(r"^Trainer = Any", text, re.M):
            found.append(f"{path.name}: Trainer = Any")
        for line in text.splitlines():
            code = line.split("#", 1)[0]
            found += [
                f"{path.name}: {m}" for m in pattern.findall(code) if m not in _PRIVATE_BY_DESIGN
            ]
    assert found == []


def test_every_module_says_its_purpose_in_the_first_line_of_its_docstring():
    """Issue 46: a one-line purpose for every module (docs/architecture.md lists the train/ ones)."""
    silent = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
    ]
    assert silent == []
    listed = (SRC.parent / "docs" / "architecture.md").read_text()
    unlisted = [
        p.name
        for p in sorted((SRC / "dpscale" / "train").glob("*.py"))
        if p.name != "__init__.py" and f"train/{p.name}" not in listed
    ]
    assert unlisted == []


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The dpscale modules ``path`` imports at its top level, ``if TYPE_CHECKING:`` blocks included
    (imports inside functions are deferred on purpose and left out)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        # TYPE_CHECKING (and other top-level ifs)
        blocks = node.body if isinstance(node, ast.If) else [node]
        for stmt in blocks:
            if (
                isinstance(stmt, ast.ImportFrom)
                and stmt.module
                and stmt.module.startswith("dpscale")
            ):
                found |= {
                    f"{stmt.module}.{a.name}"
                    for a in stmt.names
                    if f"{stmt.module}.{a.name}" in modules
                }
                found |= {stmt.module} & modules
            elif isinstance(stmt, ast.Import):
                found |= {a.name for a in stmt.names} & modules
    return found


def test_no_import_cycle_among_the_modules_type_only_imports_included():
    """Issue 64: config.py and config_validate.py imported each other (type-only); now no cycle at all."""
    paths = {
        ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }
    graph = {name: _module_imports(path, set(paths)) - {name} for name, path in paths.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return path + [name, nxt]
            if nxt not in state and (found := cycle_from(nxt, path + [name])):
                return found
        state[name] = 2
        return None

    cycles = [c for name in sorted(graph) if name not in state and (c := cycle_from(name, []))]
    assert cycles == []


# lowest first, as privacy/__init__ says
PRIVACY_ROOMS = ("accounting", "sampling", "noise", "clipping", "plan")


def _privacy_room(module: str) -> int | None:
    """The rank of ``module``'s room in privacy/ (-1: the shared options and wording at its top level;
    None: outside privacy/ or the package itself)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["dpscale", "privacy"]:
        return None
    return PRIVACY_ROOMS.index(parts[2]) if parts[2] in PRIVACY_ROOMS else -1


def test_each_privacy_room_imports_only_the_rooms_below_it_type_only_imports_included():
    from dpscale.privacy import ROOMS

    assert ROOMS == PRIVACY_ROOMS
    paths = {
        ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }
    top_level = {name: _module_imports(path, set(paths)) for name, path in paths.items()}
    upward = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        for target in sorted(targets | top_level.get(module, set()))
        if (rank := _privacy_room(module)) is not None
        and (to := _privacy_room(target)) is not None
        and to > rank
    ]
    assert upward == []
    assert (
        _privacy_room("dpscale.privacy.plan.make_plan")
        > _privacy_room("dpscale.privacy.accounting.tan")
        > _privacy_room("dpscale.privacy.options")
    )


def test_privacy_has_its_rooms_and_at_most_8_modules_at_its_top_level():
    privacy = SRC / "dpscale" / "privacy"
    assert sorted(
        p.name for p in privacy.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    ) == sorted(PRIVACY_ROOMS)
    assert len(list(privacy.glob("*.py"))) <= 8


def test_accounting_and_the_plan_load_without_torch():
    """``dpscale account`` and the plan's checks stay torch-free: every module of both rooms imported
    in a fresh interpreter leaves torch unloaded."""
    import subprocess
    import sys

    names = sorted(
        ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for room in ("accounting", "plan")
        for p in (SRC / "dpscale" / "privacy" / room).rglob("*.py")
    )
    assert len(names) > 10
    code = f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\nassert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_lazy_package_lists_what_it_imports_on_first_use():
    """A lazy package's ``__all__`` and ``__dir__`` name exactly the names its ``__getattr__`` serves,
    and each of them imports (a misspelt submodule or name would surface only at a user's call)."""
    import importlib

    lazy = [
        name
        for name, path in (
            (".".join(p.relative_to(SRC).parent.parts), p) for p in SRC.rglob("__init__.py")
        )
        if "_MODULE_OF = " in path.read_text()
    ]
    assert {"dpscale.config", "dpscale.data", "dpscale.privacy", "dpscale.privacy.plan"} <= set(
        lazy
    )
    for name in lazy:
        package = importlib.import_module(name)
        assert sorted(package.__all__) == sorted(package._MODULE_OF), name
        assert set(package._MODULE_OF) <= set(dir(package)), name
        for exported in package.__all__:
            assert getattr(package, exported) is not None, f"{name}.{exported}"


def test_no_module_is_over_600_lines():
    """Issue 64: no module of src/ or tests/ over 600 lines (as ``ruff format`` writes them)."""
    tests = Path(__file__).resolve().parent
    modules = sorted([*SRC.rglob("*.py"), *tests.rglob("*.py")])
    assert len(modules) > 200  # the check looks where the code is
    too_big = [f"{p.name}: {n}" for p in modules if (n := len(p.read_text().splitlines())) > 600]
    assert too_big == []


def test_names_a_package_exported_before_the_moves_still_import_for_one_release_with_a_warning():
    import importlib

    import pytest

    for package, name, home in [
        ("dpscale.data", "PoissonSampler", "dpscale.privacy.sampling.samplers"),
        ("dpscale.data", "SAMPLING_MODES", "dpscale.privacy.sampling.modes"),
        ("dpscale.features", "data_norm_release", "dpscale.privacy.accounting.segments"),
    ]:
        with pytest.warns(DeprecationWarning, match=f"{package}.{name} moved to {home}.{name}"):
            old = getattr(importlib.import_module(package), name)
        assert old is getattr(importlib.import_module(home), name)
        assert name not in dir(importlib.import_module(package))
    with pytest.raises(AttributeError):
        _ = importlib.import_module("dpscale.data").NoSuchName
