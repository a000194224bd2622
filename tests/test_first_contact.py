"""Pieces of 'first contact' (what a newcomer meets): module hygiene, --version, PyTorch-style habits."""

import importlib
import re
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv import MultiHeadAttention, scaled_dot_product_attention as sdpa

from conftest import to_np

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ["masks", "mods", "variants", "softmax", "attention", "heads", "layers", "positional", "rope", "cache", "text", "scaling", "viz", "flash", "dropout"]


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
    np.testing.assert_array_equal(out, sdpa(q, q, q, mask=qkv.masks.from_torch(key_padding_mask=~pad, kind="mha")))
    np.testing.assert_array_equal(out, sdpa(q, q, q, mask=qkv.masks.padding(pad.astype(int))))  # a Hugging Face attention_mask


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


# ------------------------------------------------------------ first contact, second round (issue 27)
def qkv_cli(*args, cwd=None, env=None, input=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, cwd=cwd, env=env, input=input, timeout=timeout)


def test_every_mention_of_from_torch_names_the_convention():
    """The README, the docs and every docstring and message: from_torch is never shown without kind=."""
    import re

    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src").rglob("*.py"))]
    def call_at(text, start):  # from_torch(...) up to its own closing parenthesis
        depth = 0
        for end in range(start, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0 and text[end] == ")":
                return text[start - len("from_torch") : end + 1]
        return text[start:]

    calls = [(f.name, call_at(t, m.end() - 1)) for f in files for t in [f.read_text()] for m in re.finditer(r"\bfrom_torch\(", t)]
    calls = [(name, c) for name, c in calls if "kind: str" not in c]  # not the signature itself
    assert calls, "no from_torch examples found"
    for name, call in calls:
        assert "kind=" in call or call in ("from_torch()",), (name, call)
    readme = (ROOT / "README.md").read_text()
    assert "scaled_dot_product_attention` `True` = may attend" in readme.replace("\n  ", " ") or "True` = may attend (as in qkv)" in readme
    with pytest.raises(TypeError, match=r"qkv.masks.from_torch\(m, kind='sdpa'\).*kind='mha'"):
        sdpa(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), mask=np.zeros((2, 2)))


TORCH_NAMES = [
    (lambda x: sdpa(x, x, x, attn_mask=None), re.escape("scaled_dot_product_attention() has no argument 'attn_mask' (PyTorch's name): qkv calls it mask=")),
    (lambda x: sdpa(x, x, x, key_padding_mask=None), "has no argument 'key_padding_mask'.*qkv.masks.padding"),
    (lambda x: sdpa(x, x, x, need_weights=True), "qkv calls it return_weights=True"),
    (lambda x: sdpa(x, x, x, enable_gqa=True), "grouped-query attention needs no flag in qkv"),
    (lambda x: sdpa(x, x, x, dropout=0.1), "qkv calls it dropout_p="),
    (lambda x: qkv.scaled_dot_product_attention_vjp(x, x, x, attn_mask=None), "scaled_dot_product_attention_vjp\\(\\) has no argument 'attn_mask'"),
    (lambda x: qkv.attention_weights(x, x, attn_mask=None), "attention_weights\\(\\) has no argument 'attn_mask'"),
    (lambda x: qkv.softmax(x, dim=-1), "softmax\\(\\) has no argument 'dim' \\(PyTorch's name\\): qkv calls it axis="),
    (lambda x: qkv.logsumexp(x, dim=-1), "logsumexp\\(\\) has no argument 'dim'"),
    (lambda x: qkv.logsumexp(x, keepdim=True), "qkv calls it keepdims="),
    (lambda x: MultiHeadAttention(4, 2, dropout=0.1), "MultiHeadAttention\\(\\) has no argument 'dropout'.*dropout_p="),
    (lambda x: MultiHeadAttention(4, 2, bias=False), "qkv calls it use_bias="),
    (lambda x: MultiHeadAttention(4, 2, batch_first=True), "always batch first"),
    (lambda x: MultiHeadAttention(3, 1)(x, need_weights=True), "MultiHeadAttention\\(\\) has no argument 'need_weights'.*return_weights=True"),
    (lambda x: MultiHeadAttention(3, 1)(x, key_padding_mask=None), "has no argument 'key_padding_mask'"),
    (lambda x: MultiHeadAttention(3, 1)(x, average_attn_weights=False), "weights.mean\\(axis=1\\)"),
]


@pytest.mark.parametrize("call, match", TORCH_NAMES)
def test_pytorch_argument_names_say_what_qkv_calls_them(call, match):
    with pytest.raises(TypeError, match=match):
        call(np.ones((2, 4, 3)))


def test_an_unknown_argument_keeps_pythons_message():
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        sdpa(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3)), colour=1)


def test_dash_reads_standard_input_in_every_command(tmp_path):
    """One rule for "-": wherever a TEXT, PROMPT or QUERY goes, "-" reads it from standard input."""
    r = qkv_cli("demo", "-", "--format", "json", "--no-plots", input="the cat sat\n")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] == "the cat sat"  # the final newline is not part of the text
    a = json.loads(qkv_cli("embed", "-", "dogs bark", "--json", input="a river bank\n").stdout)
    b = json.loads(qkv_cli("embed", "a river bank", "dogs bark", "--json").stdout)
    assert a["texts"] == b["texts"] and np.allclose(a["embeddings"], b["embeddings"])
    r = qkv_cli("embed", "-", "-", input="x")
    assert r.returncode == 2 and "'-' (standard input) can stand for one TEXT only" in r.stderr
    r = qkv_cli("generate", "-", "--max-new-tokens", "2", "--json", input="The sky is\n")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt"] == "The sky is"
    r = qkv_cli("attention", "-", "--out", str(tmp_path), input="hello there\n")
    assert r.returncode == 0 and "'hello'" in r.stdout, r.stderr
    r = qkv_cli("demo", "-", "--no-plots", input="")
    assert r.returncode == 2 and r.stderr.startswith("qkv: error: TEXT is empty")
    r = qkv_cli("demo", "-", "--no-plots", input=None)  # nothing piped in (stdin not a terminal under pytest: empty)
    assert r.returncode == 2


def test_embed_input_says_which_lines_were_cut_in_one_line_of_its_own(tmp_path):
    lines = ["short one", "long " * 400, "another", "long " * 300, "fine"]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    r = qkv_cli("embed", "--input", "c.txt", "--output", "c.npy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    err = r.stderr.strip().splitlines()
    assert "qkv: warning: 2 texts were longer than max_seq_length=256 tokens and truncated to it: lines 2 and 4 (counted from 1)" in err
    assert "Warning" not in r.stderr and "warnings.warn" not in r.stderr and ".py:" not in r.stderr
    # the library says the same, with the numbers to act on
    from qkv.models import embed_file, load_model
    from qkv.models.errors import TruncationWarning

    with pytest.warns(TruncationWarning) as caught:
        res = embed_file(load_model(), tmp_path / "c.txt", tmp_path / "d.npy")
    assert res["truncated_lines"] == [2, 4] and caught[0].message.numbers == [2, 4]


def test_search_names_what_an_index_is_and_counts_lines_as_editors_do(tmp_path):
    lines = ["The river bank was steep.", "I deposited cash at the bank.", "", "Dogs bark at night.", "The stock market fell."]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    assert qkv_cli("embed", "--input", "c.txt", "--output", "c.npy", cwd=tmp_path).returncode == 0
    r = qkv_cli("search", "x", "--index", "c.txt", cwd=tmp_path)
    assert r.returncode == 2 and "--index: c.txt is not a .npy file" in r.stderr and "pickle" not in r.stderr
    r = qkv_cli("search", "money in a bank account", "--index", "c.npy", "--texts", "c.txt", "-k", "2", cwd=tmp_path)
    out = r.stdout.splitlines()
    assert out[0].split() == ["score", "line", "text"]
    score, line, *text = out[1].split()
    assert int(line) == 2 and " ".join(text) == lines[1]  # grep -n and editors call it line 2
    grep = subprocess.run(["grep", "-n", "deposited", "c.txt"], capture_output=True, text=True, cwd=tmp_path).stdout
    assert grep.startswith(f"{line}:")
    got = json.loads(qkv_cli("search", "money in a bank account", "--index", "c.npy", "--texts", "c.txt", "-k", "2", "--json", cwd=tmp_path).stdout)
    assert got["results"][0]["line"] == 2 and got["results"][0]["row"] == 1 and got["results"][0]["text"] == lines[1]


def test_generate_says_it_is_loading_and_that_its_rate_is_the_decode_rate():
    r = qkv_cli("generate", "The capital of France is", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    err = r.stderr.strip().splitlines()
    assert err[0] == "qkv: loading gemma3-270m ..."
    # (a first run on a fresh cache says how long it compiled, once: see test_a_closing_line_says_compiling_once)
    assert "; decode " in err[-1] and re.search(r"tokens/s(; and [0-9.]+ s compiling kernels, once)?\]$", err[-1]) and "prefill 6 prompt tokens" in err[-1]


def test_a_closing_line_says_compiling_once(monkeypatch):
    """Seconds numba spent compiling since the last closing line are said on it (generate leaves them out
    of its rates), and only once: a chat's later turns say nothing of them."""
    from types import SimpleNamespace

    from qkv import _numba_cache
    from qkv.cli import generate

    out = SimpleNamespace(stop_reason="length", timings={"new_tokens": 3, "prompt_tokens": 6, "prefill_s": 9.5, "decode_tokens_per_s": 1.5})
    monkeypatch.setattr(generate, "_said", [0.0])
    monkeypatch.setitem(_numba_cache._compiled, "seconds", 0.0)
    assert generate._closing_line(out) == "[3 tokens, stop: length; prefill 6 prompt tokens in 9.50 s; decode 1.5 tokens/s]"
    monkeypatch.setitem(_numba_cache._compiled, "seconds", 12.34)
    assert generate._closing_line(out).endswith("; decode 1.5 tokens/s; and 12.3 s compiling kernels, once]")
    assert generate._closing_line(out).endswith("; decode 1.5 tokens/s]")


def test_ctrl_c_during_embed_input_says_resume_goes_on(tmp_path, interruptible):
    import signal
    import time

    (tmp_path / "c.txt").write_text("\n".join(f"line number {i} of a corpus" for i in range(3000)) + "\n")
    with subprocess.Popen([sys.executable, "-m", "qkv", "embed", "--input", "c.txt", "--output", "c.npy", "--batch-size", "4"], cwd=tmp_path, stderr=subprocess.PIPE, text=True) as p:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "c.npy.progress.json").exists():
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1]
    rows = json.loads((tmp_path / "c.npy.progress.json").read_text())["rows"]
    last = err.strip().splitlines()[-1]
    assert last.startswith("qkv: interrupted: ") and f"of 3,000 rows are in c.npy; the same command with --resume goes on from there" in last, err
    assert int(last.split(": ")[2].split(" of ")[0].replace(",", "")) >= rows - 64
    r = qkv_cli("embed", "--input", "c.txt", "--output", "c.npy", "--batch-size", "4", "--resume", cwd=tmp_path, timeout=600)
    assert r.returncode == 0 and "resumed at row" in r.stderr, r.stderr


def test_train_runs_without_safetensors_and_says_the_weights_are_not_saved(tmp_path):
    fake = tmp_path / "fake" / "safetensors"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named safetensors')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    r = qkv_cli("train", "reverse", "--steps", "3", "--out", "out", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("training a transformer on the reverse task")
    assert "the weights will not be saved (model.safetensors needs the models extra" in r.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "loss.png").exists()
    assert "model.safetensors" not in r.stdout


def test_train_pictures_name_the_heads_the_cli_names(tmp_path):
    from qkv import train

    r = qkv_cli("train", "induction", "--steps", "30", "--out", "out", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    scores = {name: np.array(s) for name, s in got["heads"].items()}
    for name, s in scores.items():  # the CLI's strongest head is the argmax over layers and heads, from 0
        layer, head = np.unravel_index(np.argmax(s), s.shape)
        assert got["strongest"][name]["layer"] == layer and got["strongest"][name]["head"] == head
    best = train.strongest_heads(scores)
    for layer in range(2):
        title = train.layer_title("induction", layer, 2, best)
        for name, (lay, head, _) in best.items():
            said = f"{name.replace('_', '-')} head {head} (" in title
            assert said == (lay == layer), (title, best)
    # a head that is strongest in its layer but not overall is never named (the old titles did that)
    weak = {"induction": (1, 3, 0.68)}
    assert "induction head" not in train.layer_title("induction", 0, 2, weak)


def test_readme_says_what_the_test_command_costs_and_how_to_build_the_wheel():
    readme = (ROOT / "README.md").read_text()
    first = readme.split("```bash", 1)[1].split("```", 1)[0]
    after = readme.split("```", 2)[2][:1500]
    assert "minutes" in after and "GB" in after  # how long the test command takes and how much it installs
    assert "python -m build" in readme or "pip wheel" in readme  # the wheel line has its build step
    assert "a induction" not in readme and first.count("\n") == 3
