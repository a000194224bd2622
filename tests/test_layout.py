"""The house: the README's map matches the tree, the family table is the one place loaders look, old paths still import."""

import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "qkv"


def _map() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"## Where things are\n\n```\n(.*?)```", text, flags=re.S).group(1)


def test_the_readme_map_names_every_module_and_only_modules_that_exist():
    block = _map()
    words = set(re.findall(r"[A-Za-z_0-9]+", block))
    modules = [p for p in SRC.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    missing = sorted(str(p.relative_to(SRC)) for p in modules if p.stem not in words)
    assert not missing, f"README's 'Where things are' does not name {missing}"
    named = set(re.findall(r"([A-Za-z_0-9]+)\.py", block))
    stems = {p.stem for p in SRC.rglob("*.py")}
    assert named <= stems, f"README names modules that do not exist: {sorted(named - stems)}"
    for folder in re.findall(r"^\s+([a-z_]+)/", block, flags=re.M):
        assert (SRC / folder).is_dir() or (SRC / "models" / folder).is_dir(), folder


def test_every_family_in_the_table_gives_what_the_loaders_call():
    from qkv.models import families
    from qkv.models.load import GGUF_ARCHITECTURES, HF_FAMILIES, SEQ2SEQ_FAMILIES

    assert HF_FAMILIES == ("gemma3_text", "gemma2", "llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_oss", "bloom")
    assert SEQ2SEQ_FAMILIES == ("t5", "bart", "marian", "whisper") and GGUF_ARCHITECTURES == ("gemma3", "llama", "qwen2", "qwen3", "gpt2")
    for family in families.FAMILIES:
        module = families.load_module(family)
        assert callable(module.from_hf), family.name
        assert callable(getattr(module, "from_gguf", None)) == bool(family.gguf_architectures), family.name
        for t in family.model_types:
            assert families.find(family.engine, model_type=t) is family
    files = {p.stem for p in (SRC / "models" / "families").glob("*.py")} - {"__init__"}
    assert files == {f.name for f in families.FAMILIES}  # a family module outside the table would never load


@pytest.mark.parametrize("engine, key, value, match", [
    ("causal", "model_type", "mamba", r"f: model_type 'mamba' is not a supported causal LM; supported: \['gemma3_text', 'gemma2', 'llama', 'mistral', 'qwen2', 'qwen3', 'gpt2', 'gpt_oss', 'bloom'\]"),
    ("causal", "architecture", "phi3", r"f: GGUF architecture 'phi3' is not supported; qkv reads 'gemma3', 'llama', 'qwen2', 'qwen3', 'gpt2'"),
    ("seq2seq", "model_type", "pegasus", r"f: model_type 'pegasus' is not a supported encoder-decoder; supported: \['t5', 'bart', 'marian', 'whisper'\]"),
])  # fmt: skip
def test_an_unknown_family_is_an_error_listing_the_table(engine, key, value, match):
    from qkv.models import ModelError, families

    with pytest.raises(ModelError, match=match):
        families.find(engine, **{key: value}, source="f")


def test_old_module_paths_import_the_new_modules_with_a_warning():
    import qkv.models as m

    for old, new in m.MOVED.items():
        sys.modules.pop(f"qkv.models.{old}", None)
        with pytest.warns(DeprecationWarning, match=rf"qkv.models.{old} is now qkv.models.{re.escape(new)}"):
            module = importlib.import_module(f"qkv.models.{old}")
        assert module is importlib.import_module(f"qkv.models.{new}")
        assert module.__spec__.name == f"qkv.models.{new}"  # its lazy relative imports still resolve from its own package
    if "quants" in vars(m):  # the import above set the package's attribute; the attribute form asks __getattr__
        delattr(m, "quants")
    with pytest.warns(DeprecationWarning, match="qkv.models.quants is now qkv.models.formats.quants"):
        from qkv.models import quants  # noqa: F401 - the attribute form
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from qkv.models.formats import quants as new  # the new path: no warning
    assert quants is new


def test_the_core_imports_no_model_code_and_the_modules_form_a_tree():
    """qkv's core never imports qkv.models or the CLI at module level, and no module-level import cycle exists."""
    import ast

    graph = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(("qkv", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.parse(path.read_text()).body:  # module level only: imports inside functions are lazy on purpose
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if (SRC.parent / (sub.replace(".", "/") + ".py")).exists() or (SRC.parent / sub.replace(".", "/")).is_dir() else target)
        graph[name] = {d for d in deps if d != name}
    core = [n for n in graph if n.count(".") == 1 and not n.startswith(("qkv.models", "qkv.cli", "qkv.__main__"))]
    for n in core:
        assert not any(d.startswith(("qkv.models", "qkv.cli")) for d in graph[n]), (n, graph[n])
    state = {}

    def visit(n, path):
        if state.get(n) == "done":
            return
        assert state.get(n) != "open", f"import cycle: {' -> '.join(path + [n])}"
        state[n] = "open"
        for d in graph.get(n, ()):
            if d.startswith(n + "."):  # a package importing its own modules is not a cycle
                continue
            visit(d, path + [n])
        state[n] = "done"

    for n in graph:
        visit(n, [])
