"""transformers' own tables and class attributes, read from its installed source files without importing it.

Importing transformers' auto classes or a modelling module pulls in torch and takes seconds; the launching host's
checks (``shardtune check``) only need names: which model types exist, which class ``AutoModelForCausalLM`` builds
for one, and which attention kernels that class declares (``_supports_sdpa``, ``_supports_flash_attn``). Those are
literals in transformers' sources (the ``*_MAPPING_NAMES`` tables, class-level assignments), so they are read with
``ast``. tests/unit/test_transformers_tables.py checks the answers against the imported classes.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any

# Where the auto tables live (transformers 5): base literals, then the modules that extend them with .update().
TABLE_FILES = ("models/auto/auto_mappings.py", "models/auto/configuration_auto.py", "models/auto/modeling_auto.py",
               "models/auto/tokenization_auto.py")
KERNEL_ATTRIBUTES = {"_supports_sdpa": "sdpa", "_supports_flash_attn": "flash", "_supports_flash_attn_2": "flash",
                     "_supports_attention_backend": "any kernel registered with transformers"}


@functools.cache
def transformers_root() -> Path | None:
    """The installed transformers package folder (found, not imported)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _parsed(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


@functools.cache
def auto_tables() -> dict[str, dict[str, Any]]:
    """Every ``NAME = OrderedDict([...])`` / ``{...}`` table of the auto modules, with their ``NAME.update(...)``."""
    root = transformers_root()
    tables: dict[str, dict[str, Any]] = {}
    for relative in TABLE_FILES:
        tree = _parsed(root / relative) if root else None
        for node in tree.body if tree else []:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                literal = _mapping_literal(node.value)
                if literal is None:
                    literal = _merged_mapping(node.value, tables)
                if literal is not None:
                    tables[node.targets[0].id] = literal
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and _is_update_call(node.value):
                call = node.value
                literal = _mapping_literal(call.args[0]) if call.args else None
                if literal is not None and isinstance(call.func, ast.Attribute) and isinstance(call.func.value,
                                                                                               ast.Name):
                    tables.setdefault(call.func.value.id, {}).update(literal)
    return tables


def _is_update_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name))


def _mapping_literal(node: ast.AST) -> dict[str, Any] | None:
    """The mapping an ``OrderedDict([...])`` or ``{...}`` literal builds (None for anything computed)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("OrderedDict", "dict") \
            and len(node.args) == 1:
        node = node.args[0]
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return None
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and all(isinstance(item, tuple) and len(item) == 2 for item in value):
        return dict(value)
    return None


def _merged_mapping(node: ast.AST, tables: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """``OrderedDict(**{...}, **NAME)``: literal mappings and tables read so far, merged in order."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("OrderedDict", "dict")
            and not node.args and node.keywords and all(k.arg is None for k in node.keywords)):
        return None
    merged: dict[str, Any] = {}
    for keyword in node.keywords:
        part = tables.get(keyword.value.id) if isinstance(keyword.value, ast.Name) else _mapping_literal(keyword.value)
        if part is None:
            return None
        merged.update(part)
    return merged


def table(name: str) -> dict[str, Any]:
    return auto_tables().get(name, {})


def known_model_types() -> set[str]:
    return set(table("CONFIG_MAPPING_NAMES"))


def causal_lm_class_name(model_type: str) -> str | None:
    return table("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES").get(model_type)


def module_name(model_type: str) -> str:
    """transformers' ``model_type_to_module_name``: the folder under ``transformers/models``."""
    special = table("SPECIAL_MODEL_TYPE_TO_MODULE_NAME")
    return special.get(model_type, model_type.replace("-", "_"))


def modelling_file(model_type: str) -> Path | None:
    root = transformers_root()
    if root is None:
        return None
    name = module_name(model_type)
    path = root / "models" / name / f"modeling_{name}.py"
    return path if path.is_file() else None


def class_attributes(path: Path, class_name: str) -> dict[str, Any] | None:
    """The kernel attributes of ``class_name`` defined in ``path``, inherited ones included (bases in the same
    file or imported from a sibling modelling file); None when the class is not there."""
    tree = _parsed(path)
    if tree is None:
        return None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if class_name not in classes:
        return None
    found: dict[str, Any] = {}
    for base in reversed(classes[class_name].bases):  # later bases first: earlier ones win, as in the MRO
        if isinstance(base, ast.Name):
            found.update(_base_attributes(path, tree, classes, base.id))
    found.update(_own_attributes(classes[class_name]))
    return found


def _base_attributes(path: Path, tree: ast.Module, classes: dict[str, ast.ClassDef], name: str) -> dict[str, Any]:
    if name in classes:
        return class_attributes(path, name) or {}
    source = _imported_from(path, tree, name)
    return (class_attributes(source, name) or {}) if source is not None else {}


def _imported_from(path: Path, tree: ast.Module, name: str) -> Path | None:
    """The sibling modelling file a ``from ..x.modeling_x import Name`` takes ``name`` from."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module and \
                any(alias.name == name for alias in node.names):
            candidate = path.parent.parent / (node.module.replace(".", "/") + ".py")
            return candidate if candidate.is_file() else None
    return None


def _own_attributes(node: ast.ClassDef) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for item in node.body:
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) \
            else []
        value = getattr(item, "value", None)
        for target in targets:
            if isinstance(target, ast.Name) and target.id in KERNEL_ATTRIBUTES and value is not None:
                try:
                    found[target.id] = ast.literal_eval(value)
                except ValueError:
                    pass
    return found


def find_class_file(model_type: str, class_name: str) -> Path | None:
    """The modelling file that defines ``class_name`` for ``model_type``: its own module's (any modelling file of
    that folder), else the module of a model type whose causal LM is that class (``internlm3`` -> llama's)."""
    root = transformers_root()
    if root is None:
        return None
    owners = [model_type] + [other for other, name in table("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES").items()
                             if name == class_name and other != model_type]
    for owner in owners:
        folder = root / "models" / module_name(owner)
        own = folder / f"modeling_{module_name(owner)}.py"
        for path in [own, *sorted(folder.glob("modeling_*.py"))] if folder.is_dir() else []:
            if path.is_file() and class_attributes(path, class_name) is not None:
                return path
    return None
