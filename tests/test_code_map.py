"""The code map holds: collectives only where docs/ARCHITECTURE.md says, kernels a leaf, no cycles.

Each rule is checked by reading the source (``ast``), so it costs no process group and
no GPU. Each checker is first shown to catch a planted violation, so a checker that
silently finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# torch.distributed calls that communicate (point-to-point and collective).
COLLECTIVES = frozenset(
    [
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "send_object_list",
        "recv_object_list",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
    ]
)
# layers.mappings' names for torch's flat collectives (one shim across torch versions).
SHIMS = frozenset({"flat_all_gather", "flat_reduce_scatter"})
# Where communication may happen (docs/ARCHITECTURE.md, "Collectives by file").
ALLOWED = (
    "layers/mappings.py",  # the TP operators and plain TP helpers
    "layers/tp_grads.py",  # the TP sum of partial gradients both DP strategies call
    "layers/ring_attention.py",  # context parallelism: K/V and dK/dV around the cp ring
    "layers/expert_parallel.py",  # expert parallelism: token rows to their experts' ranks
    "engine/comm.py",  # run-level: metric means, agreement, checkpoint hand-offs, barriers
    "engine/data_parallel/",  # the DP strategies (gradient reduction, ZeRO-1)
    # Benchmarks that time collectives on purpose.
    "studies/perfmodel/calibrate.py",
    "studies/scaling/linkbench.py",
)


def collective_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every torch.distributed collective (or shim) the source refers to,
    called or passed along (``timed(t, dist.all_reduce, x)``)."""
    tree = ast.parse(source)
    aliases: set[str] = set()  # names bound to the torch.distributed module
    direct: set[str] = set()  # collectives imported by name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    aliases.add(a.asname or a.name)
                elif node.module.startswith("torch.distributed") and a.name in COLLECTIVES:
                    direct.add(a.asname or a.name)
                    found.append((node.lineno, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = node.value
            is_dist = isinstance(base, ast.Name) and base.id in aliases
            is_dist |= ast.unparse(base) == "torch.distributed"
            if is_dist:
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Attribute) and node.attr in SHIMS:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and (node.id in direct or node.id in SHIMS):
            found.append((node.lineno, node.id))
    return sorted(set(found))


def _python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def test_collective_scanner_catches_planted_calls():
    planted = (
        "import torch.distributed as dist\n"
        "from torch.distributed import barrier\n"
        "import torch\n"
        "dist.all_reduce(x, group=g)\n"
        "timed(timer, dist.all_gather_into_tensor, out, x)\n"
        "torch.distributed.broadcast_object_list(box)\n"
        "barrier()\n"
        "flat_reduce_scatter(out, x)\n"
        "dist.get_rank(); dist.is_initialized(); dist.new_group([0])\n"  # not communication
    )
    assert collective_uses(planted) == [
        (2, "barrier"),
        (4, "all_reduce"),
        (5, "all_gather_into_tensor"),
        (6, "broadcast_object_list"),
        (7, "barrier"),
        (8, "flat_reduce_scatter"),
    ]


def test_collectives_only_in_the_files_the_map_names():
    """``grep -rn "dist\\." layers/ engine/`` reads as a map: no collective elsewhere."""
    outside = []
    for path in _python_files("layers", "engine", "apps"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ALLOWED):
            continue
        outside += [f"{rel}:{line} {name}" for line, name in collective_uses(path.read_text())]
    assert not outside, (
        "collectives outside layers/mappings.py, engine/comm.py and the DP code; use their "
        "helpers (or add the file to the map in docs/ARCHITECTURE.md and ALLOWED):\n"
        + "\n".join(outside)
    )
    # The allowed files really are where the collectives are (the scan sees them).
    assert collective_uses((ROOT / "layers/mappings.py").read_text())
    assert collective_uses((ROOT / "engine/comm.py").read_text())


def lazy_exports(init: Path) -> dict[str, str]:
    """A package's names loaded on first use (PEP 562): its ``_EXPORTS`` literal, name →
    the submodule defining it (empty when the package has none)."""
    if not init.exists():
        return {}
    for node in ast.parse(init.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "_EXPORTS":
            return ast.literal_eval(node.value)
    return {}


def imported_modules(path: Path, package_root: Path) -> set[str]:
    """Every module ``path`` imports (also inside functions and ``TYPE_CHECKING``), with
    ``from pkg import name`` resolved to ``pkg.name`` when that is a module of the tree,
    or to the submodule a lazy package loads for ``name`` (its ``_EXPORTS``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            package = package_root / node.module.replace(".", "/")
            lazy = lazy_exports(package / "__init__.py")
            for a in node.names:
                sub = package / a.name
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                if is_module:
                    out.add(f"{node.module}.{a.name}")
                elif a.name in lazy:
                    out |= {node.module, f"{node.module}.{lazy[a.name]}"}
                else:
                    out.add(node.module)
    return out


def _module_name(path: Path, package_root: Path) -> str:
    parts = path.relative_to(package_root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` plus the package ``__init__`` each import runs first: importing
    ``a.b.c`` from outside ``a.b`` executes ``a/b/__init__.py`` before ``c``, so a loop
    through a package's ``__init__`` (hidden behind a lazy, function-local import of a
    submodule) is a loop too."""
    out = {}
    for module, targets in graph.items():
        mine = module.split(".")
        inits = {
            ".".join(parts[:i])
            for parts in (t.split(".") for t in targets)
            for i in range(1, len(parts))
            if mine[:i] != parts[:i] and ".".join(parts[:i]) in graph
        }
        out[module] = (targets | inits) - {module}
    return out


def import_graph(package: str, package_root: Path = ROOT) -> dict[str, set[str]]:
    """Module → the modules of ``package`` it imports."""
    graph = {}
    for path in sorted((package_root / package).rglob("*.py")):
        name = _module_name(path, package_root)
        graph[name] = {
            m for m in imported_modules(path, package_root) if m.split(".")[0] == package
        } - {name}
    return with_package_inits(graph)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_cycle_finder_catches_a_planted_circle(tmp_path):
    """The circle issue 11 removed: attention imported transformer (for a type) and back."""
    root = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.transformer import Layer\n",
            "pkg/transformer.py": "from pkg.attention import Attention\n",
            "pkg/attention.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg.transformer import Config\n"
            ),
            "pkg/leaf.py": "import torch\n",
        },
    )
    assert find_cycle(import_graph("pkg", root)) == [
        "pkg.transformer",
        "pkg.attention",
        "pkg.transformer",
    ]
    (root / "pkg/attention.py").write_text("from pkg import leaf\n")
    assert find_cycle(import_graph("pkg", root)) is None


def test_cycle_finder_sees_a_loop_through_a_package_init(tmp_path):
    """The loop issue 38 found: the config imported the pipeline cut lazily, the cut's
    package ``__init__`` imported its stages, the stages the data pipeline, and that the
    config. No module names the config's importer directly: the ``__init__`` closes it."""
    root = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/config.py": "def check():\n    from pkg.cut.split import rule\n",
            "pkg/cut/__init__.py": "from pkg.cut.stages import Stages\n",
            "pkg/cut/split.py": "",
            "pkg/cut/stages.py": "from pkg.feed import to_device\n",
            "pkg/feed.py": "from pkg.config import Config\n",
        },
    )
    assert find_cycle(import_graph("pkg", root)) == [
        "pkg.config",
        "pkg.cut",
        "pkg.cut.stages",
        "pkg.feed",
        "pkg.config",
    ]
    (root / "pkg/cut/stages.py").write_text("")
    assert find_cycle(import_graph("pkg", root)) is None
    # A lazy package (PEP 562) loads the submodule of the name asked for: still a loop.
    (root / "pkg/config.py").write_text("def check():\n    from pkg.cut import Runner\n")
    (root / "pkg/cut/__init__.py").write_text('_EXPORTS = {"Runner": "run"}\n')
    (root / "pkg/cut/run.py").write_text("from pkg.feed import to_device\n")
    assert find_cycle(import_graph("pkg", root)) == [
        "pkg.config",
        "pkg.cut.run",
        "pkg.feed",
        "pkg.config",
    ]


def test_no_import_cycle_among_layers():
    graph = import_graph("layers")
    assert "layers.attention" in graph and "layers.kernels.dispatch" in graph  # it scanned
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in layers/: " + " -> ".join(cycle)


def upward_imports(graph: dict[str, set[str]], leaf: str = "layers.kernels") -> list[str]:
    """ "module imports target" for every import from ``leaf`` to outside it."""
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith(leaf)
        for target in targets
        if not target.startswith(leaf)
    )


def test_leaf_checker_catches_a_planted_upward_import(tmp_path):
    root = _plant(
        tmp_path,
        {
            "layers/mappings.py": "",
            "layers/kernels/__init__.py": "from layers.kernels import ce\n",
            "layers/kernels/ce.py": "def f():\n    from layers import mappings\n",
        },
    )
    assert upward_imports(import_graph("layers", root)) == [
        "layers.kernels.ce imports layers.mappings"
    ]


def test_layers_kernels_is_a_leaf():
    """layers/kernels/ imports nothing from layers/ above it (nor anything of ours but
    itself): kernels compute; the layers that use them communicate."""
    graph = import_graph("layers")
    assert "layers.kernels.cross_entropy_triton" in graph  # it scanned the kernels
    above = upward_imports(graph)
    assert not above, "layers/kernels must stay a leaf:\n" + "\n".join(above)
    for path in _python_files("layers/kernels"):
        ours = {
            m
            for m in imported_modules(path, ROOT)
            if m.split(".")[0]
            in ("engine", "parallel_state", "apps", "studies", "configs", "tools")
        }
        assert not ours, f"{path.relative_to(ROOT)} imports {sorted(ours)}"


# The packages in their one-way order: each may import those before it, never after
# (docs/ARCHITECTURE.md, "The map").
PACKAGE_ORDER = ("parallel_state", "layers", "engine", "apps", "studies")
# engine's entries: what starts a rank or a run. The packages inside engine/ (data,
# models, checkpoint, ...) serve them and never import them back.
ENGINE_ENTRIES = frozenset(
    {
        "engine.pretrain",
        "engine.worker",
        "engine.bootstrap",
        "engine.trainer",
        "engine.evaluate",
    }
)


def tree_graph(packages: tuple[str, ...] = PACKAGE_ORDER, root: Path = ROOT) -> dict:
    """Module → the modules of any of ``packages`` it imports (lazy and type-only too)."""
    graph = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = _module_name(path, root)
            imported = imported_modules(path, root)
            graph[name] = {m for m in imported if m.split(".")[0] in packages} - {name}
    return with_package_inits(graph)


def back_arrows(graph: dict[str, set[str]], order: tuple[str, ...] = PACKAGE_ORDER) -> list[str]:
    """Imports that run back up: into a later package, or from a package inside engine/
    into one of engine's entries."""
    rank = {p: i for i, p in enumerate(order)}
    found = []
    for module, targets in graph.items():
        for target in targets:
            upward = rank[target.split(".")[0]] > rank[module.split(".")[0]]
            inner = module.startswith("engine.") and module.count(".") >= 2
            if upward or (
                inner
                and target.split(".")[:2]
                and ".".join(target.split(".")[:2]) in ENGINE_ENTRIES
            ):
                found.append(f"{module} imports {target}")
    return sorted(found)


def test_back_arrow_checker_catches_planted_upward_imports(tmp_path):
    root = _plant(
        tmp_path,
        {
            "parallel_state/__init__.py": "",
            "layers/__init__.py": "",
            "studies/__init__.py": "",
            "engine/__init__.py": "",
            "engine/trainer.py": "import layers\n",
            "engine/flops.py": "def f():\n    from studies import perf\n",
            "studies/perf.py": "from engine import flops\n",
            "engine/resilience/__init__.py": "",
            "engine/resilience/watchdog.py": "def run():\n    from engine.trainer import x\n",
        },
    )
    assert back_arrows(tree_graph(root=root)) == [
        "engine.flops imports studies",  # the package __init__ that import runs first
        "engine.flops imports studies.perf",
        "engine.resilience.watchdog imports engine.trainer",
    ]


def test_no_import_circles_in_the_runtime_and_the_studies():
    graph = tree_graph()
    assert {"engine.trainer", "apps.classify_loop", "studies.perfmodel.model"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_imports_run_back_up():
    arrows = back_arrows(tree_graph())
    assert not arrows, "imports against the map's one-way arrows:\n" + "\n".join(arrows)


def _calls(source: str, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, dotted callee) of every call whose last name is in ``names``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            if callee.rsplit(".", 1)[-1] in names:
                found.append((node.lineno, callee))
    return found


def _callers(names: frozenset[str], *dirs: str) -> dict[str, list]:
    out = {}
    for path in _python_files(*dirs):
        if hits := _calls(path.read_text(), names):
            out[path.relative_to(ROOT).as_posix()] = hits
    return out


def test_call_finder_sees_aliased_and_plain_calls():
    src = "import parallel_state as ps\nps.initialize(d)\ndist.new_group([0])\nnew_group(r)\nx.size()\n"
    assert _calls(src, frozenset({"initialize", "new_group"})) == [
        (2, "ps.initialize"),
        (3, "dist.new_group"),
        (4, "new_group"),
    ]


def test_one_place_initializes_process_groups():
    """The mesh's process groups are made in parallel_state alone, and only
    engine/bootstrap.py asks for them: every entry point goes through bootstrap_rank."""
    dirs = ("parallel_state", "layers", "engine", "apps", "studies", "tools")
    makers = _callers(frozenset({"init_process_group", "new_group"}), *dirs)
    # Two study benchmarks time raw collectives on a world of their own, outside any mesh.
    benchmarks = {"studies/perfmodel/calibrate.py", "studies/scaling/linkbench.py"}
    assert set(makers) - benchmarks == {"parallel_state/__init__.py", "parallel_state/groups.py"}
    initializers = _callers(frozenset({"initialize"}), *dirs)
    assert set(initializers) == {"engine/bootstrap.py"}, initializers


def layout_builds(source: str) -> list[tuple[int, str]]:
    """(line, callee) of every ``ParallelDims(...)`` or ``ParallelDims.resolve(...)`` call."""
    return [
        (line, callee)
        for line, callee in _calls(source, frozenset({"ParallelDims", "resolve"}))
        if callee.rsplit(".", 1)[0].endswith("ParallelDims") or callee.endswith("ParallelDims")
    ]


def test_layout_finder_catches_planted_builds():
    planted = (
        "dims = ParallelDims(2, 1)\n"
        "d = parallel_state.ParallelDims.resolve(tp, dp, world)\n"
        "root = Path(x).resolve()\n"  # not a layout
    )
    assert layout_builds(planted) == [
        (1, "ParallelDims"),
        (2, "parallel_state.ParallelDims.resolve"),
    ]


# Where a ParallelDims may be built, besides parallel_state/ itself (its own short form).
LAYOUT_BUILDERS = frozenset(
    {
        # The one place a run's config (parallel_dims) or sizes (sized_dims: classify,
        # generate, the studies' tools) become the layout.
        "engine/config.py",
        # The layout a checkpoint was saved at (not this run's), asked which ranks held what.
        "engine/checkpoint/layout.py",
        # The verifier compares many layouts in one process: each spec is a layout of its own.
        "studies/verification/layouts.py",
    }
)


def test_one_place_builds_the_layout():
    """A run's ParallelDims is built once, in the entry, from engine/config.py; the runtime
    and the applications are handed it (docs/ARCHITECTURE.md, "The map")."""
    found = {
        rel: hits
        for path in _python_files("layers", "engine", "apps", "studies", "tools")
        if (hits := layout_builds(path.read_text()))
        and (rel := path.relative_to(ROOT).as_posix()) not in LAYOUT_BUILDERS
    }
    assert not found, f"build the layout through engine/config.py: {found}"
    assert layout_builds((ROOT / "engine/config.py").read_text())  # the scan sees the place


def rank_formulas(source: str) -> list[int]:
    """Lines that compute the rank layout: a rank split by the TP size (``rank % tp``,
    ``rank // tp``), a rank built from coordinates (``dp_rank * tp + tp_rank``), ranks
    strided by tp (``range(t, world, tp)``) or a grid of ranks (``arange(world).view``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        text = ast.unparse(node) if isinstance(node, (ast.BinOp, ast.Call)) else ""
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.FloorDiv)):
            hit = "rank" in ast.unparse(node.left) and "tp" in ast.unparse(node.right)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            hit = "rank" in text and "tp" in text and "*" in text
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "range":
            hit = len(node.args) == 3 and "tp" in ast.unparse(node.args[2])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = node.func.attr == "view" and "arange" in ast.unparse(node.func.value)
        else:
            hit = False
        if hit:
            found.append(node.lineno)
    return sorted(set(found))


def test_rank_formula_finder_catches_planted_formulas():
    planted = (
        "tp_rank = rank % tp_size\n"
        "dp = rank // tp\n"
        "r = dp_rank * tp + tp_rank\n"
        "replicas = list(range(t, world, tp_size))\n"
        "grid = torch.arange(world).view(dp, tp)\n"
        "heads = num_heads // tp_size\n"  # a width split, not the layout
    )
    assert rank_formulas(planted) == [1, 2, 3, 4, 5]


def test_one_place_builds_the_rank_layout():
    """Which ranks form which group is computed by ParallelDims (parallel_state/dims.py)
    alone: no other file writes the rank formula or lays out a grid of ranks."""
    hits = [
        f"{path.relative_to(ROOT).as_posix()}:{line}"
        for path in _python_files("parallel_state", "layers", "engine", "apps", "studies", "tools")
        if path.relative_to(ROOT).as_posix() != "parallel_state/dims.py"
        for line in rank_formulas(path.read_text())
    ]
    assert not hits, "the rank formula outside parallel_state/dims.py:\n" + "\n".join(hits)


def formatter_opt_outs(source: str) -> list[int]:
    """Lines that hold code out of ``ruff format`` (its skip and off markers)."""
    marker = "# fmt" + ": "  # split so this file does not flag itself
    return [
        n
        for n, line in enumerate(source.splitlines(), 1)
        if any(marker + word in line for word in ("skip", "off"))
    ]


def test_opt_out_finder_catches_planted_markers():
    planted = "x = [1,2]  # fmt" + ": skip\n# fmt" + ": off\ny = 1\n"
    assert formatter_opt_outs(planted) == [1, 2]


def test_the_formatter_sees_all_the_code():
    """ruff format lays out every line; hand-packed lines held out of it read denser than
    they are (the tree had 417 such markers)."""
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("parallel_state", "layers", "engine", "apps", "studies", "tools", "tests")
        for path in (ROOT / top).rglob("*.py")
        for n in formatter_opt_outs(path.read_text())
    ]
    assert not found, f"remove the formatter opt-outs: {found[:10]}"


def role_writes(source: str, roles: frozenset[str]) -> list[int]:
    """Lines that set or read a parameter role's attribute by hand: ``setattr`` on anything,
    ``getattr(p, "<role>")``, or ``p.<role> = ...``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "getattr"):
            name = node.args[1] if len(node.args) > 1 else None
            by_hand = ast.unparse(node.func) == "setattr"
            by_hand |= isinstance(name, ast.Constant) and name.value in roles
            if by_hand:
                found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in roles:
            found += [node.lineno] if isinstance(node.ctx, ast.Store) else []
    return sorted(set(found))


def _role_names() -> frozenset[str]:
    from layers import param_roles

    names = {v for k, v in vars(param_roles).items() if k.startswith("_") and k[1:].isupper()}
    return frozenset(n for n in names if isinstance(n, str))


def test_role_finder_catches_planted_attributes():
    roles = _role_names()
    assert "tp_split_dim" in roles and "sequence_parallel_grad" in roles  # it found them
    planted = (
        "setattr(p, SP_GRAD, True)\n"
        "d = getattr(p, 'tp_split_dim', None)\n"
        "p.tp_replicas = 2\n"
        "getattr(module, 'weight')\n"  # not a role
        "flag = spec.vocab_padded\n"  # a checkpoint index field of that name, read
    )
    assert role_writes(planted, roles) == [1, 2, 3]


# Files that may call setattr for something other than a parameter role.
SETATTR_ALLOWED = frozenset(
    {
        "layers/param_roles.py",  # the roles themselves
        "layers/utils.py",  # attach_comm_timer: a timer on modules, not a parameter role
    }
)


def test_parameter_roles_are_declared_in_one_module():
    """TP split dim, replicas, the sequence-parallel partial gradient and the padded
    vocabulary are set and read through layers/param_roles.py alone (the layers set them,
    the DP strategies, checkpoints and HF interop read them)."""
    roles = _role_names()
    hits = [
        f"{path.relative_to(ROOT).as_posix()}:{line}"
        for path in _python_files("layers", "engine", "apps", "studies", "tools")
        if path.relative_to(ROOT).as_posix() not in SETATTR_ALLOWED
        for line in role_writes(path.read_text(), roles)
    ]
    assert not hits, "set parameter roles through layers.param_roles:\n" + "\n".join(hits)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def family_mentions(
    source: str, names: frozenset[str], *, words: bool = True
) -> list[tuple[int, str]]:
    """(line, word) where code names a family: a word of an identifier (a name, attribute,
    definition, argument, keyword or imported module, split at ``_`` and ``.``) or of a
    string that is no docstring (split at anything not a letter or digit) equals one of
    ``names`` (compared lowercase). ``words=False`` compares whole identifiers and whole
    strings instead, so a preset name ("gpt_tiny") or a formula named after the family
    that first needed it does not count, while ``arch == "llama"`` or ``w.bert`` does."""
    tree = ast.parse(source)
    skip, found = _docstrings(tree), []

    def check(line: int, text: str, pattern: str) -> None:
        parts = re.findall(pattern, text) if words else [text]
        found.extend((line, w) for w in parts if w.lower() in names)

    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        identifiers = []
        if isinstance(node, ast.Name):
            identifiers = [node.id]
        elif isinstance(node, ast.Attribute | ast.FunctionDef | ast.AsyncFunctionDef):
            identifiers = [getattr(node, "attr", None) or node.name]
        elif isinstance(node, ast.ClassDef):
            identifiers = [node.name]
        elif isinstance(node, ast.arg | ast.keyword):
            identifiers = [node.arg or ""]
        elif isinstance(node, ast.alias):
            identifiers = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            identifiers = [node.module or ""]
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        ):
            check(line, node.value, r"[A-Za-z0-9]+")
        for identifier in identifiers:
            check(line, identifier, r"[^_.]+")
    return sorted(set(found))


def _family_names() -> frozenset[str]:
    from engine.models.families import FAMILIES

    return frozenset(n.lower() for f in FAMILIES.values() for n in (f.arch, f.model))


def test_family_finder_catches_planted_mentions():
    names = _family_names()
    assert {"gpt", "bert", "llama", "gptmodel", "bertmodel", "llamamodel"} <= names
    planted = (
        '"""A docstring may say GPT-2: prose is not code."""\n'
        "from engine.models.bert import BertModel\n"
        "if isinstance(model, GPTModel): pass\n"
        "self.bert = True\n"
        'roles = {"llama": 1}\n'
        "def llama_roles(gpt_heads=None): pass\n"
        'x = f"{arch}_bert_tiny"\n'
        "decoder, robert, gpt2 = 1, 2, 3\n"  # no family's name as a word
        "# a comment about BERT\n"
    )
    assert family_mentions(planted, names) == [
        (2, "BertModel"),
        (2, "bert"),
        (3, "GPTModel"),
        (4, "bert"),
        (5, "llama"),
        (6, "gpt"),
        (6, "llama"),
        (7, "bert"),
    ]


def test_whole_name_finder_catches_planted_uses():
    planted = (
        "from engine.models import GPTModel\n"
        "if cfg.arch == 'llama':\n"
        "    pass\n"
        "ok = w.bert\n"
        "def gpt(x): return x\n"
        "name = 'gpt_tiny'  # a preset name: data\n"
        "isinstance(m, BertModel)\n"
        "flops = llama_flops_per_iteration(w)\n"
    )
    found = family_mentions(planted, _family_names(), words=False)
    assert [line for line, _ in found] == [1, 2, 4, 5, 7]


def test_the_pipeline_cut_and_checkpoints_name_no_family():
    """engine/pipeline/ and engine/checkpoint/ ask the model (its hooks, ``Family`` data)
    instead of naming a family: no family name (``FAMILIES``' keys) or model class name is
    an identifier, attribute, imported module or string there. Compared word by word
    through ``ast``, not as raw text: comments and docstrings are prose about the code,
    which may describe "a decoder" or "an encoder" (they are not what the code branches
    on), and a word such as ``robert`` or ``gpt2`` is not a family's name."""
    names = _family_names()
    hits = [
        f"{path.relative_to(ROOT).as_posix()}:{line} {word}"
        for path in _python_files("engine/pipeline", "engine/checkpoint")
        for line, word in family_mentions(path.read_text(), names)
    ]
    assert not hits, "ask the model or its Family entry instead:\n" + "\n".join(hits)


def test_studies_name_no_model_family():
    """studies/ (the planner, the verifier, benchmarks, scaling) asks the family table
    (engine/models/families.py: traits, each family's costs.py and tiny preset) instead of
    branching on a family's name or class; a new family then needs no edit there. The
    planner reads the table without torch (studies/perfmodel/family_table.py), and its
    default family is the config's."""
    from engine.models import FAMILIES, ModelConfig
    from studies.perfmodel import family_table

    names = _family_names()
    hits = [
        f"{path.relative_to(ROOT).as_posix()}:{line} {word}"
        for path in _python_files("studies")
        for line, word in family_mentions(path.read_text(), names, words=False)
    ]
    assert not hits, "ask engine/models/families.py, not a family's name:\n" + "\n".join(hits)
    assert family_table.FAMILIES is FAMILIES
    assert ModelConfig.arch == family_table.DEFAULT_ARCH


def test_engine_imports_no_app_and_its_config_no_dataset():
    """apps/ are built on engine/, never the reverse (the classifier's schemas live in
    apps/classify_config.py); engine/config.py checks the data config through the leaf
    engine/data/weights.py, not the datasets of engine/data/blend.py."""
    hits = [
        f"{path.relative_to(ROOT).as_posix()} imports {module}"
        for path in _python_files("engine")
        for module in sorted(imported_modules(path, ROOT))
        if module.split(".")[0] == "apps"
    ]
    assert not hits, hits
    config = imported_modules(ROOT / "engine" / "config.py", ROOT)
    assert "engine.data.blend" not in config and "engine.data.weights" in config, config


def pipeline_branches(source: str) -> list[int]:
    """Lines of an ``if``/conditional expression/``match`` whose test names the pipeline: a
    ``pipeline`` attribute or name, ``pp_size``/``pp_rank``, a ``PipelineRunner``."""
    words = ("pipeline", "pp_size", "pp_rank", "PipelineRunner", "is_first", "is_last")
    found = []
    for node in ast.walk(ast.parse(source)):
        test = node.test if isinstance(node, ast.If | ast.IfExp | ast.While) else None
        test = node.subject if isinstance(node, ast.Match) else test
        if test is not None and any(w in ast.unparse(test) for w in words):
            found.append(node.lineno)
    return sorted(found)


def test_branch_finder_catches_planted_pipeline_branches():
    planted = (
        "if self.pipeline is not None:\n    pass\n"
        "x = a if ps.pp_size > 1 else b\n"
        "if self.step > 3:\n    pass\n"
        "while isinstance(r, PipelineRunner):\n    break\n"
    )
    assert pipeline_branches(planted) == [1, 3, 6]


def test_the_trainer_is_mode_blind_and_short():
    """The trainer holds one step runner, chosen once (engine/runner/); it never asks
    whether the step is pipelined (eight such branches at fcedf18), and stays under 400
    lines (555 at fcedf18)."""
    source = (ROOT / "engine/trainer.py").read_text()
    assert not pipeline_branches(source), pipeline_branches(source)
    assert len(source.splitlines()) < 400


def test_the_runtime_asks_the_mesh_by_role():
    """engine/ and apps/ ask ``ps.group("grad" | "batch" | "loss" | "replica")`` for what
    they mean; only the mesh itself (parallel_state/) and the DP strategies, which are
    handed the grad group and reduce over it, say ``dp_group`` (22 runtime files asked for
    dp_group, dp_rank or dp_size at fcedf18)."""
    allowed = "engine/data_parallel/"
    hits = [
        f"{path.relative_to(ROOT).as_posix()}:{node.lineno}"
        for path in _python_files("engine", "apps")
        if not path.relative_to(ROOT).as_posix().startswith(allowed)
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Name) and node.id == "dp_group")
        or (isinstance(node, ast.Attribute) and node.attr == "dp_group")
        or (isinstance(node, ast.keyword) and node.arg == "dp_group")
        or (isinstance(node, ast.arg) and node.arg == "dp_group")
    ]
    assert not hits, "ask the mesh by role (ps.group('grad'), ...):\n" + "\n".join(hits)
