"""Every ComfyUI symbol the pack uses exists on the running host, and the pack's calls bind to it (issue 11,
item 6): the next upstream rename or signature change fails a test named after the symbol.

The list is derived from the pack's source with ``ast`` (``__init__.py``, ``nodes/``, ``memory/``), so a new
use is covered without editing this file:

* imports of ComfyUI's modules (``comfy``, ``comfy_api``, ``comfy_execution``, ``folder_paths``, ``nodes``,
  ``server``) and the attribute chains used on the names they bind (``mm.get_free_memory``,
  ``io.Int.Input``), plus the same chains on parameters named ``mm`` (``memory/`` takes
  ``comfy.model_management`` as ``mm`` and imports nothing from ComfyUI), in every ``.py`` of the pack
  (``memory/``'s subpackages included: they import nothing from ComfyUI and take no ``mm``, so they add no
  symbol here; the host's model code they rely on by structure, reached through the model objects ComfyUI hands
  them, ``sys.modules[type(x).__module__]`` included, is pinned per family in ``test_family_symbols.py``);
* each call of such a symbol with its shape (number of positional arguments, keyword names), checked with
  ``inspect.signature(...).bind``.

Uses the pack makes optional on purpose (``getattr(mod, "name", default)`` / ``hasattr(mod, "name")`` in the
same file) are left out. Methods called on objects ComfyUI hands the pack (a VAE, a ModelPatcher) cannot be
typed from the source; they are the small table ``HANDED_OBJECT_CALLS``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
from typing import Any

import pytest

pytestmark = pytest.mark.host

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOST_MODULES = ("comfy", "comfy_api", "comfy_execution", "folder_paths", "nodes", "server")
PARAMETER_MODULES = {"mm": "comfy.model_management"}
"""Parameters that hold a ComfyUI module by the pack's convention (``memory/offload.py``)."""

# Methods of objects ComfyUI hands the pack, by class: qualified name -> (positional args, keyword names)
# of the pack's call (the instance not counted).
HANDED_OBJECT_CALLS: dict[str, tuple[int, tuple[str, ...]]] = {
    "comfy.sd.VAE.decode": (1, ()),  # memory/decode/image.py: vae.decode(z)
    "comfy.sd.VAE.throw_exception_if_invalid": (0, ()),  # nodes/*: _validate
    "comfy.sd.VAE.model_size": (0, ()),  # nodes/bf16_loader.py
    "comfy.model_patcher.ModelPatcher.model_size": (0, ()),  # nodes/_comfy.py, memory/offload.py
    "comfy.model_patcher.ModelPatcher.loaded_size": (0, ()),
    "comfy.model_patcher.ModelPatcher.set_model_compute_dtype": (1, ()),  # nodes/bf16_loader.py
}
VAE_ATTRIBUTES = ("first_stage_model", "patcher", "device", "vae_dtype", "latent_channels", "upscale_ratio",
                  "process_output")  # fmt: skip
"""Attributes of a loaded ``comfy.sd.VAE`` the decode engines read (set in ``VAE.__init__``)."""


@dataclasses.dataclass(frozen=True)
class Use:
    symbol: str
    """Dotted path from a host module, e.g. ``comfy.model_management.get_free_memory``."""
    where: str
    """``file:line`` of the first use."""
    call: tuple[int, tuple[str, ...]] | None = None
    """A call's (positional args, keyword names); None for a reference."""
    partial: bool = False
    """The call also passes ``*args``/``**kwargs``: only the listed arguments are checked."""


def _is_host(module: str) -> bool:
    return module.split(".")[0] in HOST_MODULES


def _import_bindings(node: ast.AST) -> dict[str, str]:
    """Names bound to host modules/symbols by the imports in ``node``'s own body (not nested functions)."""
    bound: dict[str, str] = {}
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(child, ast.Import):
            for a in child.names:
                if _is_host(a.name):
                    # ``import comfy.utils`` binds ``comfy``; ``import comfy.utils as cu`` binds the module
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and _is_host(child.module):
            for a in child.names:
                bound[a.asname or a.name] = f"{child.module}.{a.name}"
        stack.extend(ast.iter_child_nodes(child))
    return bound


def _optional_names(tree: ast.AST) -> set[tuple[str, str]]:
    """``(name, attribute)`` pairs the file probes with ``getattr(name, "attr", ...)`` / ``hasattr(name, "attr")``."""
    probed = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                and isinstance(node.args[1], ast.Constant)):  # fmt: skip
            probed.add((node.args[0].id, node.args[1].value))
    return probed


class _Collector(ast.NodeVisitor):
    def __init__(self, path: pathlib.Path, tree: ast.Module):
        self.rel = path.relative_to(ROOT).as_posix()
        self.scopes = [_import_bindings(tree)]
        self.optional = _optional_names(tree)
        self.uses: list[Use] = [Use(target, f"{self.rel}:1") for target in self.scopes[0].values()]

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope = dict(self.scopes[-1])
        for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
            if arg.arg in PARAMETER_MODULES:
                scope[arg.arg] = PARAMETER_MODULES[arg.arg]
        scope.update(_import_bindings(node))
        self.uses += [Use(t, f"{self.rel}:{node.lineno}") for t in _import_bindings(node).values()]
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function  # noqa: N815

    def _resolve(self, node: ast.AST) -> str | None:
        """The host symbol an ``a.b.c`` expression names, if ``a`` is bound to a host module or symbol."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.scopes[-1]:
            return None
        if parts and (node.id, parts[-1]) in self.optional:
            return None
        return ".".join([self.scopes[-1][node.id], *reversed(parts)])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        symbol = self._resolve(node)
        if symbol is None:
            self.generic_visit(node)  # e.g. ``mm.f(x).y``: the chain inside still counts
        else:
            self.uses.append(Use(symbol, f"{self.rel}:{node.lineno}"))

    def visit_Call(self, node: ast.Call) -> None:
        symbol = self._resolve(node.func)
        if symbol is not None:
            positional = [a for a in node.args if not isinstance(a, ast.Starred)]
            keywords = tuple(sorted(k.arg for k in node.keywords if k.arg is not None))
            partial = len(positional) != len(node.args) or any(k.arg is None for k in node.keywords)
            self.uses.append(Use(symbol, f"{self.rel}:{node.lineno}", (len(positional), keywords), partial))
        self.generic_visit(node)


def pack_files() -> list[pathlib.Path]:
    """Every ``.py`` of the pack: ``__init__.py`` and ``nodes/`` and ``memory/`` recursively (the engine's
    subpackages ``memory/vae``, ``memory/plan``, ``memory/decode``, ... included)."""
    return [ROOT / "__init__.py", *sorted((ROOT / "nodes").rglob("*.py")), *sorted((ROOT / "memory").rglob("*.py"))]


def collect_uses(path: pathlib.Path) -> list[Use]:
    tree = ast.parse(path.read_text(), filename=str(path))
    collector = _Collector(path, tree)
    collector.visit(tree)
    return collector.uses


USES = [u for path in pack_files() for u in collect_uses(path)]
SYMBOLS = {u.symbol: u.where for u in reversed(USES)}  # first use wins
CALLS = {(u.symbol, u.call, u.partial): u.where for u in reversed(USES) if u.call is not None}


def resolve(symbol: str) -> Any:
    """The object at ``symbol``: the longest importable module prefix, then attributes."""
    parts = symbol.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module of {symbol!r} imports")


def _bind(obj: Any, positional: int, keywords: tuple[str, ...], partial: bool) -> None:
    signature = inspect.signature(obj)
    args, kwargs = [object()] * positional, {k: object() for k in keywords}
    (signature.bind_partial if partial else signature.bind)(*args, **kwargs)


def _host(host_config) -> str:
    return f"ComfyUI {host_config.version}"


# ------------------------------------------------------------------------------------------ the derived list


def test_the_list_covers_the_pack() -> None:
    """The collector sees the pack's known uses: if it did not, every other test here would pass vacuously."""
    for expected in ("comfy.model_management.get_free_memory", "comfy.model_management.load_models_gpu",
                     "comfy_api.v0_0_2.io.Schema", "comfy_api.v0_0_2.io.Int.Input", "folder_paths.get_full_path",
                     "comfy.utils.ProgressBar", "comfy.model_management.free_memory"):  # fmt: skip
        assert expected in SYMBOLS, expected
    # memory/ reaches ComfyUI only through its ``mm`` parameter
    assert any(u.symbol == "comfy.model_management.free_memory" and u.where.startswith("memory/offload.py:")
               for u in USES)  # fmt: skip
    assert any(symbol == "comfy_api.v0_0_2.io.Schema" and call[1] for symbol, call, _ in CALLS)
    # every .py of the engine is read, its subpackages included
    files = set(pack_files())
    assert {ROOT / "memory" / "vae" / "families.py", ROOT / "memory" / "plan" / "host_grid.py",
            ROOT / "memory" / "decode" / "env.py", ROOT / "memory" / "offload.py"} <= files  # fmt: skip
    assert files == {ROOT / "__init__.py", *(ROOT / "nodes").rglob("*.py"), *(ROOT / "memory").rglob("*.py")}


def test_memory_imports_nothing_from_the_host() -> None:
    for path in sorted((ROOT / "memory").rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                    and any(_is_host(m) for m in _imported_modules(n))]  # fmt: skip
        assert not imported, f"{path.relative_to(ROOT)} imports ComfyUI at lines {imported}"


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module] if node.level == 0 and node.module else []


def test_the_collector_resolves_aliases_chains_calls_and_probes() -> None:
    source = (
        "import comfy.model_management as mm\nimport comfy.utils\nfrom comfy_api.v0_0_2 import io\n"
        "def f(x):\n    import folder_paths as fp\n    fp.get_full_path('vae', x)\n"
        "    comfy.utils.ProgressBar(3).update(1)\n    io.Int.Input('n', default=1)\n"
        "    if hasattr(mm, 'new_thing'):\n        mm.new_thing()\n    return mm.get_free_memory(*x)\n"
    )
    path = ROOT / "nodes" / "example.py"
    tree = ast.parse(source)
    collector = _Collector(path, tree)
    collector.visit(tree)
    got = {(u.symbol, u.call, u.partial) for u in collector.uses}
    assert ("folder_paths.get_full_path", (2, ()), False) in got
    assert ("comfy.utils.ProgressBar", (1, ()), False) in got
    assert ("comfy_api.v0_0_2.io.Int.Input", (1, ("default",)), False) in got
    assert ("comfy.model_management.get_free_memory", (0, ()), True) in got
    assert not any(u.symbol.endswith("new_thing") for u in collector.uses)


# ------------------------------------------------------------------------------------------ on the host


def test_a_missing_symbol_or_a_changed_signature_is_caught(comfy) -> None:
    with pytest.raises(AttributeError):
        resolve("comfy.model_management.no_such_function")
    get_free_memory = resolve("comfy.model_management.get_free_memory")
    _bind(get_free_memory, 1, (), False)
    with pytest.raises(TypeError):
        _bind(get_free_memory, 1, ("no_such_keyword",), False)


@pytest.mark.parametrize("symbol", sorted(SYMBOLS))
def test_symbol_exists_on_the_host(comfy, host_config, symbol) -> None:
    try:
        resolve(symbol)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{symbol} (used at {SYMBOLS[symbol]}) is missing on {_host(host_config)}: {e}")


@pytest.mark.parametrize(
    "symbol,call,partial", sorted(CALLS, key=str), ids=lambda v: v if isinstance(v, str) else None
)
def test_call_binds_on_the_host(comfy, host_config, symbol, call, partial) -> None:
    positional, keywords = call
    try:
        obj = resolve(symbol)
    except (ImportError, AttributeError):
        pytest.skip(f"{symbol} is missing (test_symbol_exists_on_the_host fails for it)")
    try:
        _bind(obj, positional, keywords, partial)
    except ValueError:  # no signature to read (some builtins): existence is all there is to check
        assert callable(obj), symbol
    except TypeError as e:
        pytest.fail(f"{symbol} called with {positional} positional argument(s) and keywords {list(keywords)} at "
                    f"{CALLS[(symbol, call, partial)]} does not bind on {_host(host_config)}: {e}")  # fmt: skip


@pytest.mark.parametrize("method", sorted(HANDED_OBJECT_CALLS))
def test_handed_object_method_binds(comfy, host_config, method) -> None:
    positional, keywords = HANDED_OBJECT_CALLS[method]
    try:
        _bind(resolve(method), positional + 1, keywords, False)  # + the instance
    except (ImportError, AttributeError, TypeError) as e:
        pytest.fail(f"{method} as the pack calls it ({positional} argument(s)) fails on {_host(host_config)}: {e}")


def test_loaded_vae_has_the_attributes_the_engines_read(kl_vae, host_config) -> None:
    missing = [a for a in VAE_ATTRIBUTES if not hasattr(kl_vae, a)]
    assert not missing, f"comfy.sd.VAE on {_host(host_config)} lacks {missing}"
