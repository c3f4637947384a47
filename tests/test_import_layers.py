"""No module imports a module of a higher layer, at module level or inside a function: data flows one way,
checkpoint -> expert store -> expert cache -> expert pipeline -> models -> engine -> generation -> CLI and server
(docs/ARCHITECTURE.md). Read from the source with ``ast``; a new module must be given its layer here."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moestream"

# lowest first; a module may import modules of its own layer or lower ones
LAYERS = [
    ("helpers any layer may use", "errors memory nnutil policies budget options textstream tokenizer counters"),
    ("checkpoint", "checkpoint"),
    ("formats: the stored forms and their math", "mlx_format gguf_format quant quant.registry quant.affine "
     "quant.fp8 quant.mxfp4 quant.ggml quant.formats "
     "quant.compressed quant.turboquant quant.hadamard quant.native quant.kernels"),
    ("expert layout", "layout"),
    ("expert store", "store direct_io"),
    ("expert cache", "cache tiered_cache host_tier copy_engine slot_pool prefetch io_setup"),
    ("expert pipeline and its GPU kernels", "pipeline fused_moe attention_kernel dense_kernel"),
    ("models", "models models.*"),
    ("a checkpoint of any source opened", "sources"),
    ("quantized models, convert, synthetic checkpoints", "quant.model quant.expert quant.resident convert synth "
     "synth_*"),
    ("engine", "load_plan engine decode_graph usage cachesim traces prefix_cache"),
    ("generation", "sampling generation_stats generation ep_group ep_placement ep_exchange ep_requests parallel "
     "scheduler"),
    ("API, server, inspect", "api server serverguard inspect"),
    ("command line", "cli cli.* stream_generate __main__ __init__"),
]
# imports that break the order on purpose, each with its reason (none today)
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _layer_of(module: str) -> int:
    for i, (_, names) in enumerate(LAYERS):
        for pattern in names.split():
            if module == pattern or (pattern.endswith("*") and module.startswith(pattern[:-1])):
                return i
    raise AssertionError(f"moestream.{module} has no layer in tests/test_import_layers.py: give it one")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"] or ["__init__"]
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = PACKAGE.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _edges(path: Path):
    """(target module relative to the package, line) for every moestream import in ``path``."""
    me = _module_name(path)
    package = me.split(".") if path.name == "__init__.py" and me != "__init__" else me.split(".")[:-1]
    if me == "__init__":
        package = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("moestream"):
                target = node.module[len("moestream."):] if node.module != "moestream" else ""
            else:
                continue
            for alias in node.names:  # ``from . import memory``: the submodule itself
                sub = f"{target}.{alias.name}" if target else alias.name
                yield (sub if _is_module(sub) else target or "__init__"), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("moestream."):
                    yield alias.name[len("moestream."):], node.lineno


def test_no_module_imports_a_higher_layer():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        mine = _layer_of(me)
        for target, line in _edges(path):
            if _layer_of(target) > mine and (me, target) not in EXCEPTIONS:
                wrong.append(f"moestream/{path.relative_to(PACKAGE)}:{line}: {me} ({LAYERS[mine][0]}) imports "
                             f"{target} ({LAYERS[_layer_of(target)][0]})")
    assert not wrong, "imports that run upward:\n" + "\n".join(wrong)


def test_the_check_sees_function_level_imports(tmp_path):
    """The walk finds an import inside a function, and names the submodule of ``from . import x``."""
    src = PACKAGE / "budget.py"
    assert ("memory", next(n for t, n in _edges(src) if t == "memory")) in list(_edges(src))
    edges = [t for t, _ in _edges(PACKAGE / "engine.py")]
    assert "tokenizer" in edges  # imported inside load()
    assert _layer_of("models.qwen3_moe") > _layer_of("pipeline") > _layer_of("cache") > _layer_of("store")


def test_imports_inside_functions_only_where_start_up_time_needs_them():
    """Outside the command line (which starts without torch and imports each command's modules when it runs),
    every moestream import is at module level: none hides inside a function to dodge a cycle."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _module_name(path).split(".")[0] == "cli":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("moestream")):
                    wrong.append(f"moestream/{path.relative_to(PACKAGE)}:{node.lineno} (in {fn.name})")
    assert not wrong, "moestream imports inside functions:\n" + "\n".join(wrong)
