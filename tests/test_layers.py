"""Import layers of the package, checked from the source with `ast` (function-local imports
included): no import cycle, no import of the package root from inside the package, and no
arrow against the layer table

    jpeg → ops → sources/sampler → batch → transport → loaders/worker → CLI

(a module may import its own layer and the layers before it). A module the table does not list
fails with its name: add it to LAYERS below when adding or moving a module.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dpu_pipe"

#: The layers, first to last, and the modules (dotted, without the ``dpu_pipe.`` prefix; a
#: package by its own name) in each. The root package is the public facade: it may import
#: anything, nothing inside may import it.
LAYERS = [
    ("jpeg", ["constants", "errors", "_validate", "_version", "_torch", "deadline", "_jpeg",
              "_ops", "_rng",
              "_pipeline", "_augment", "_mix", "jpeg", "build_info"]),
    ("ops", ["ops", "rng", "progressive", "views", "transforms", "augment", "mix", "weights"]),
    ("sources/sampler", ["sources", "sources.base", "sources.folder", "sources.filelist",
                         "sources.packed", "sources.webdataset", "sources.parquet",
                         "sampler", "packed", "packed.format", "packed.reader",
                         "packed.writer"]),
    ("batch", ["spec", "cache", "kernel", "batch", "evaluate", "models"]),
    ("transport", ["mpi", "device", "offload.wire", "offload.transport", "offload.transport.endpoint",
                   "offload.transport.failures", "offload.transport.host",
                   "offload.transport.producer", "offload.roles", "offload.rendezvous",
                   "offload.channel", "offload.node_cache", "offload.group",
                   "offload.scheduler"]),
    ("loaders/worker", ["resume", "engines", "engines.base", "engines.local", "engines.offload",
                        "loader", "torch_dataset", "offload",
                        "offload.validation", "offload.producer_loop", "worker", "distributed"]),
    ("CLI", ["__main__", "tools", "tools.cli", "tools.progress", "tools.plots",
             "tools.sample_data", "tools.harness", "tools.baselines",
             "tools.bench_augment", "tools.bench_train", "tools.demo", "tools.plan"]),
]

#: Known violations waiting for their fix elsewhere, each (importer, imported) with the reason.
#: An entry that no longer occurs fails the test, so the list only shrinks.
PENDING = {}

#: Compiled kernels: imported like modules, no source to parse.
COMPILED = {"_jpeg", "_ops", "_rng", "_pipeline", "_augment", "_mix"}


def module_files(root, package):
    """{dotted name relative to the package ('' for the root): path} for every .py file."""
    base = root / package
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name, path, known):
    """Sorted set of package modules (relative dotted names, '' = the root) that module
    ``name`` imports anywhere in its body, with the line of the first such import."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if name else []
    pkg = here if is_pkg else here[:-1]
    found = {}

    def add(target, line):
        found.setdefault(target, line)

    def resolve(dotted):
        # The longest known module prefix of dotted (an imported name may be a function).
        parts = dotted.split(".") if dotted else []
        while parts and ".".join(parts) not in known:
            parts.pop()
        return ".".join(parts)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top == PACKAGE:
                    add(resolve(rest), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(pkg):
                    raise AssertionError(f"{path}:{node.lineno}: relative import above the "
                                         "package")
                base = pkg[:len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                top, _, rest = (node.module or "").partition(".")
                if top != PACKAGE:
                    continue
                mod = rest
            for alias in node.names:
                sub = f"{mod}.{alias.name}" if mod else alias.name
                # `from . import wire` imports the module wire; `from .. import Loader` the root.
                add(sub if sub in known else resolve(mod), node.lineno)
    found.pop(name, None)
    return found


def import_graph(root=ROOT, package=PACKAGE):
    files = module_files(root, package)
    known = set(files) | COMPILED
    return {name: imports_of(name, path, known) for name, path in files.items()}


def find_cycles(graph):
    """Every strongly connected component of more than one module (or a self-loop), as sorted
    lists (Tarjan's algorithm)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(graph, layers=LAYERS, pending=None):
    """(problems, unknown modules, pending entries that no longer occur)."""
    layer_of = {m: i for i, (_, mods) in enumerate(layers) for m in mods}
    names = [n for n, _ in layers]
    unknown = sorted(m for m in graph if m and m not in layer_of)
    problems, seen_pending = [], set()
    pending = PENDING if pending is None else pending
    for src, targets in sorted(graph.items()):
        for dst, line in sorted(targets.items()):
            if (src, dst) in pending:
                seen_pending.add((src, dst))
                continue
            if src and dst == "":
                problems.append(f"{src} (line {line}) imports the package root; import the "
                                "module that defines the name instead")
            elif src and src in layer_of and dst in layer_of and layer_of[dst] > layer_of[src]:
                problems.append(f"{src} ({names[layer_of[src]]}) imports {dst} "
                                f"({names[layer_of[dst]]}) at line {line}: against the layers")
    pruned = {s: {d for d in t if (s, d) not in pending} for s, t in graph.items()}
    for cycle in find_cycles(pruned):
        problems.append("import cycle: " + " -> ".join(cycle) + " (function-local imports count)")
    stale = sorted(set(pending) - seen_pending)
    return problems, unknown, stale


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_is_in_the_layer_table(graph):
    _, unknown, _ = violations(graph)
    assert not unknown, (f"modules missing from LAYERS in {__file__}: {', '.join(unknown)} — "
                         "put each in the layer it belongs to")


def test_no_cycle_no_root_import_no_arrow_against_the_layers(graph):
    problems, _, _ = violations(graph)
    assert not problems, "\n".join(problems)


def test_pending_exceptions_still_occur(graph):
    _, _, stale = violations(graph)
    assert not stale, f"fixed, so remove from PENDING: {stale}"


def test_table_lists_each_module_once_and_only_modules_that_exist(graph):
    listed = [m for _, mods in LAYERS for m in mods]
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"listed in more than one layer: {twice}"
    ghosts = sorted(set(listed) - set(graph) - COMPILED)
    assert not ghosts, f"LAYERS lists modules that do not exist (moved or removed?): {ghosts}"


def _plant(tmp_path, files):
    for rel, text in files.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path, PACKAGE)


def test_self_check_catches_planted_problems(tmp_path):
    """The checker on a planted package: a cycle made only by a function-local import, a root
    import, an arrow against the layers and an unlisted module are each reported."""
    g = _plant(tmp_path, {
        "__init__.py": "from .loader import Loader\n",
        "errors.py": "",
        "jpeg.py": "from .errors import DpuPipeError\n",
        "batch.py": "from . import jpeg\n\ndef f():\n    from .loader import Loader\n",
        "loader.py": "from .batch import f\nfrom . import jpeg as _j\n",
        "ops.py": "def g():\n    from dpu_pipe import Loader\n",
        "sampler.py": "import dpu_pipe.loader\n",
        "stray.py": "",
    })
    assert g["batch"] == {"jpeg": 1, "loader": 4}
    assert g["ops"] == {"": 2}
    layers = [("jpeg", ["errors", "jpeg"]), ("ops", ["ops"]), ("sources/sampler", ["sampler"]),
              ("batch", ["batch"]), ("loaders/worker", ["loader"])]
    problems, unknown, stale = violations(g, layers, pending={("jpeg", "ops"): "gone"})
    text = "\n".join(problems)
    assert "import cycle: batch -> loader" in text
    assert "ops (line 2) imports the package root" in text
    assert "batch (batch) imports loader (loaders/worker) at line 4" in text
    assert "sampler (sources/sampler) imports loader (loaders/worker) at line 1" in text
    assert unknown == ["stray"]
    assert stale == [("jpeg", "ops")]
    # The same package without the planted faults is clean.
    g = _plant(tmp_path, {"batch.py": "from . import jpeg\n", "ops.py": "",
                          "sampler.py": "", "stray.py": "from . import errors\n"})
    problems, unknown, _ = violations(g, layers + [("CLI", ["stray"])], pending={})
    assert problems == [] and unknown == []
