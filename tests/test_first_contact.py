"""Pieces of 'first contact' (what a newcomer meets): module hygiene, --version, PyTorch-style habits."""

import importlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv import MultiHeadAttention, scaled_dot_product_attention as sdpa

from conftest import to_np

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ["masks", "softmax", "attention", "heads", "layers", "positional", "rope", "cache", "text", "scaling", "viz", "flash", "dropout"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_modules_list_only_their_api(name):
    mod = importlib.import_module(f"qkv.{name}")
    assert dir(mod) == sorted(mod.__all__)
    for attr in mod.__all__:
        assert hasattr(mod, attr), attr


def _imports(path: Path, package: str) -> set:
    """The qkv modules ``path`` imports, anywhere in it (functions too)."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            if node.module:
                out.add(".".join(base + node.module.split(".")))
            else:
                out.update(".".join(base + [a.name]) for a in node.names)
    return out


def test_modules_form_a_tree():
    """No import cycles between qkv's modules (attention and flash used to import each other)."""
    src = ROOT / "src"
    graph = {}
    for path in src.rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        name = name.removesuffix(".__init__")
        graph[name] = {m for m in _imports(path, package) if m != package and not name.startswith(m + ".") and m != name}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph.get(node, ()):
            if dep in graph and not dep.startswith(node + "."):
                assert state.get(dep) != "open", f"import cycle: {' -> '.join(stack + [node, dep])}"
                if dep not in state:
                    visit(dep, stack + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])
    assert "qkv.attention" not in graph["qkv.flash"]


def test_version_and_license():
    r = subprocess.run([sys.executable, "-m", "qkv", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"qkv {qkv.__version__}"
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert 'license = "MIT"' in (ROOT / "pyproject.toml").read_text()


def test_torch_style_key_padding_mask_error_says_how_to_fix():
    q = np.ones((2, 4, 6, 8))
    with pytest.raises(ValueError, match=r"mask\[:, None, None, :\].*masks.padding.*from_torch"):
        sdpa(q, q, q, mask=np.ones((2, 6), bool))
    # the suggested fix works and equals PyTorch's key_padding_mask convention converted
    pad = np.array([[True] * 6, [True] * 4 + [False] * 2])
    out = sdpa(q, q, q, mask=pad[:, None, None, :])
    np.testing.assert_array_equal(out, sdpa(q, q, q, mask=qkv.masks.from_torch(~pad, kind="key_padding_mask")))


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"kdim": 5, "vdim": 7}])
def test_layer_from_a_torch_state_dict(torch, kw):
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(12, 3, batch_first=True, **kw).double()
    ours = MultiHeadAttention.from_torch_state_dict(layer.state_dict(), layer.num_heads, dtype=np.float64)
    assert (ours.embed_dim, ours.num_heads, ours.kdim, ours.vdim, ours.use_bias) == (12, 3, kw.get("kdim", 12), kw.get("vdim", 12), kw.get("bias", True))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 12))
    k = rng.standard_normal((2, 4, kw.get("kdim", 12)))
    v = rng.standard_normal((2, 4, kw.get("vdim", 12)))
    want, _ = layer(torch.tensor(x), torch.tensor(k), torch.tensor(v))
    np.testing.assert_allclose(ours(x, k, v), to_np(want), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="out_proj.weight"):
        MultiHeadAttention.from_torch_state_dict({"weight": np.ones(3)}, 1)


def test_one_rule_for_random_defaults():
    a, b = qkv.Embedding(10, 4), qkv.Embedding(10, 4, rng=0)
    np.testing.assert_array_equal(a.table, b.table)  # default seed 0, as MultiHeadAttention
    np.testing.assert_array_equal(MultiHeadAttention(8, 2).w_query, MultiHeadAttention(8, 2, rng=0).w_query)
