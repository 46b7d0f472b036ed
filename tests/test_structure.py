"""The code's shape, checked from the source text (issue #43): no import cycles among the project's
modules, and no function over 80 lines outside the training scripts.

Read with `ast`, nothing imported: every `import` and `from ... import` counts, those inside
functions too (a lazy import is still a dependency); `from pkg import name` is an edge to the
submodule pkg.name where one exists, else to pkg itself. A package's __init__ is the module pkg.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxinfer", "pallas_kernels", "serve", "bench", "scripts")
MAX_LINES = 80
# training loops, kept whole on purpose: each reads top to bottom as the recipe it records
LONG_ALLOWED = {("scripts/train_tiny.py", "train"), ("scripts/train_medusa.py", "main")}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods}
            out.update(subs)
            if target in mods and len(subs) < len(node.names):
                out.add(target)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        u = stack.pop()
                        on_stack.discard(u)
                        comp.append(u)
                        if u == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return found


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert len(graph) > 80 and "jaxinfer.engine" in graph["jaxinfer.generator"]   # the scan sees imports
    assert _cycles(graph) == []


def test_no_function_over_80_lines():
    long = []
    for name, path in _modules().items():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES and (rel, node.name) not in LONG_ALLOWED:
                    long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


# ------------------------------------------------------------------------------ config dataclasses by keyword
CONFIG_CLASSES = {"EngineConfig", "ResolvedConfig", "PoolInputs", "ModelConfig", "SamplingParams", "SchedulerConfig",
                  "RunnerConfig", "StepSettings", "RopeScaling", "StructuredOutputs"}


def _positional_config_calls(source: str, where: str) -> list[str]:
    """Calls of a config dataclass (by name or attribute) with positional arguments."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in CONFIG_CLASSES:
                found.append(f"{where}:{node.lineno} {name}")
    return found


def test_positional_scan_finds_a_planted_call():
    planted = ("EngineConfig('auto')\nconfig.SamplingParams(16, temperature=0)\nModelConfig(**d)\n"
               "StepSettings(graphdef=g)\n")
    assert _positional_config_calls(planted, "x") == ["x:1 EngineConfig", "x:2 SamplingParams"]


def test_no_config_dataclass_constructed_positionally():
    """Settings are passed by name (the dataclasses are keyword-only): a new field cannot shift others."""
    found, scanned = [], 0
    for pkg in ("jaxinfer", "serve", "bench", "scripts", "tests"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            scanned += 1
            found += _positional_config_calls(path.read_text(), path.relative_to(ROOT).as_posix())
    assert scanned > 100 and found == []


# ------------------------------------------------------------------------------ the CLI does not load bench
_LOADED_BENCH = ("import sys, importlib\n"
                 "for m in sys.argv[1:]: importlib.import_module(m)\n"
                 "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))")


def _bench_modules_after(*modules: str) -> list[str]:
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _LOADED_BENCH, *modules], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().replace("'", '"'))


def test_importing_jaxinfer_and_its_cli_loads_no_bench_module():
    assert "bench.common" in _bench_modules_after("jaxinfer", "bench.common")   # the check sees one
    assert _bench_modules_after("jaxinfer", "jaxinfer.cli") == []


# the plain step holds no speculative code (jaxinfer/spec_decode/ does): names made of these words
SPECULATIVE_WORDS = ("spec", "medusa", "draft", "tree", "propos")
THIRD_PARTY_ROOTS = {"jax", "jnp", "np", "nnx"}   # their own names (jax.tree_util) are not ours


def _speculative_names(source: str) -> list[str]:
    """The names `source` defines or reads (functions, classes, arguments, variables, fields,
    attributes, imported names) that contain a speculative word; third-party names (imported from
    outside jaxinfer: jax.sharding.PartitionSpec) and the attributes of third-party modules are
    skipped. Docstrings and comments are text, not names, and may point to spec_decode/."""
    tree = ast.parse(source)
    third_party = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and not (node.module or "").startswith("jaxinfer") for a in node.names}
    names = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            names.append((node.lineno, node.arg))
        elif isinstance(node, ast.Name):
            names.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id in THIRD_PARTY_ROOTS):
                names.append((node.lineno, node.attr))
        elif isinstance(node, ast.keyword) and node.arg:
            names.append((node.value.lineno, node.arg))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(node.lineno, a.asname or a.name) for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append((node.lineno, node.module))
    return sorted(f"{line}: {name}" for line, name in names
                  if name not in third_party and any(word in name.lower() for word in SPECULATIVE_WORDS))


def test_the_speculative_name_scan_finds_each_kind():
    """Control: a speculative name of each kind is caught; jax's own tree_util and prose are not."""
    bad = '''
from jaxinfer.spec_decode import contract
from jaxinfer import medusa
def _medusa_step(params, draft_pages):
    x = inputs.spec.num_spec
    propose(x, tree=1)
class DraftPair:
    target_and_draft: int
'''
    hits = _speculative_names(bad)
    for name in ("jaxinfer.spec_decode", "medusa", "_medusa_step", "draft_pages", "spec", "num_spec", "propose",
                 "tree", "DraftPair", "target_and_draft"):
        assert any(hit.endswith(f": {name}") for hit in hits), (name, hits)
    good = ('from jax.sharding import PartitionSpec\n@jax.tree_util.register_dataclass\nclass StepInputs:\n'
            '    """Speculative steps: spec_decode/."""\n    sharding = PartitionSpec()\n')
    assert _speculative_names(good) == []


def test_plain_step_holds_no_speculative_code():
    """jaxinfer/step.py is the plain step only: the speculative steps, their inputs and settings live
    in jaxinfer/spec_decode/ (their step functions reach jit_step through spec_decode.jit_spec_step)."""
    assert _speculative_names((ROOT / "jaxinfer" / "step.py").read_text()) == []
