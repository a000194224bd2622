"""The command line, run as a user runs it: a subprocess."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from qkv import Embedding, MultiHeadAttention, Vocabulary, sinusoidal_position_encoding, tokenize


def run(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_demo_json_matches_the_library(tmp_path):
    text = "The cat sat on the mat, and the dog sat too."
    r = run("demo", text, "--heads", "2", "--dim", "8", "--seed", "5", "--causal", "--format", "json", "--no-plots")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    tokens = tokenize(text)
    assert got["tokens"] == tokens
    # the same steps through the public API
    rng = np.random.default_rng(5)
    vocab = Vocabulary.from_texts([text])
    emb = Embedding(len(vocab), 8, rng=rng)
    x = (emb(vocab.encode(tokens)) + sinusoidal_position_encoding(len(tokens), 8)).astype(np.float32)
    _, w = MultiHeadAttention(8, 2, rng=rng)(x, is_causal=True, return_weights=True)
    np.testing.assert_allclose(np.array(got["weights"]), w, rtol=1e-6, atol=1e-7)
    assert got["shapes"] == {"embeddings": [len(tokens), 8], "queries": [2, len(tokens), 4], "weights": [2, len(tokens), len(tokens)], "output": [len(tokens), 8]}
    assert got["files"] == []


def test_demo_default_writes_pictures_and_says_where(tmp_path):
    r = run("demo", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "head 3:" in r.stdout and "animal" in r.stdout
    for name in ("attention.png", "position_encoding.png", "embeddings_pca.png", "score_variance.png"):
        path = tmp_path / "qkv-demo" / name
        assert path.stat().st_size > 10_000
        assert os.path.join("qkv-demo", name) in r.stdout
    # rows of the printed tables sum to ~1
    table = r.stdout.split("head 0:")[1].split("head 1:")[0].strip().splitlines()[2:]
    sums = [sum(float(c) for c in line.split()[1:]) for line in table]
    assert all(abs(s - 1) < 0.07 for s in sums), sums


def test_json_lists_files(tmp_path):
    r = run("demo", "hello world", "--heads", "1", "--dim", "4", "--format", "json", "--out", str(tmp_path / "pics"))
    assert r.returncode == 0, r.stderr
    files = json.loads(r.stdout)["files"]
    assert len(files) == 4 and all(os.path.exists(f) for f in files)


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "   "], "TEXT has no words to attend over"),
        (["demo", "--heads", "3", "--dim", "8", "--no-plots"], "--dim 8 should be divisible by --heads 3"),
    ],
)
def test_errors_are_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert r.stderr.strip() == f"qkv: error: {message}" or r.stderr.strip().startswith(f"qkv: error: {message}")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    r = run("demo", "hi there", "--out", str(blocker / "pics"))
    assert r.returncode == 2
    assert r.stderr.startswith(f"qkv: error: cannot write to --out '{blocker / 'pics'}'")
    assert "Traceback" not in r.stderr


def test_missing_matplotlib(tmp_path):
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    r = run("demo", "hi there", cwd=tmp_path, env=env)
    assert r.returncode == 2
    assert r.stderr.strip() == "qkv: error: plots need matplotlib: pip install 'qkv[viz]' (or pass --no-plots)"
    assert run("demo", "hi there", "--no-plots", cwd=tmp_path, env=env).returncode == 0


def test_help_for_every_command():
    for args in (["--help"], ["demo", "--help"]):
        r = run(*args)
        assert r.returncode == 0 and "usage: qkv" in r.stdout


def test_entry_point_installed():
    import shutil

    exe = shutil.which("qkv", path=os.path.dirname(sys.executable))
    assert exe, "the qkv script is not installed next to this Python"
    r = subprocess.run([exe, "demo", "a b c", "--no-plots", "--heads", "1", "--dim", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "head 0" in r.stdout


# ------------------------------------------------------- real-model commands


def test_embed_prints_cosine_matrix_and_saves(tmp_path):
    from qkv.models import load_model

    texts = ["I sat on the river bank", "I deposited cash at the bank"]
    out = tmp_path / "e.npy"
    r = run("embed", *texts, "--json", "--output", str(out))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = load_model().encode(texts)
    np.testing.assert_allclose(np.array(got["embeddings"]), want, atol=1e-6)
    np.testing.assert_allclose(np.load(out), want, atol=1e-6)
    np.testing.assert_allclose(np.array(got["cosine"]), want @ want.T, atol=1e-5)
    r = run("embed", *texts)
    assert r.returncode == 0 and "cosine similarity" in r.stdout
    row = [line for line in r.stdout.splitlines() if line.startswith("[1]")][-1].split()
    assert abs(float(row[1]) - float(want[0] @ want[1])) < 1e-3 and row[2] == "1.000"


def test_attention_command_writes_heatmaps(tmp_path):
    r = run("attention", "The cat sat on the mat.", "--layer", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "attention_layer1.png").stat().st_size > 10_000
    assert str(tmp_path / "attention_layer1.png") in r.stdout
    r = run("attention", "The cat sat on the mat.", "--head", "3", "--out", str(tmp_path))
    assert r.returncode == 0 and (tmp_path / "attention_head3.png").is_file()
    r = run("attention", "The cat.", "--layer", "9", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip() == "qkv: error: --layer should be in [0, 5], got 9"


def test_demo_with_model_shows_bank_separating(tmp_path):
    r = run("demo", "--model", "--format", "json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    bank = [p for p in got["repeated_words"] if p["word"] == "bank"][0]
    assert bank["static_cosine"] > 0.9999 and bank["contextual_cosine"] < 0.9
    assert (tmp_path / "embeddings_pca_model.png").stat().st_size > 10_000


def test_model_errors_are_one_line(tmp_path):
    r = run("embed", "hello", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.strip() == f"qkv: error: {tmp_path / 'missing'}: not a model directory"


# ------------------------------------------------------------------ causal language models
@pytest.fixture(scope="module")
def lm():
    from qkv.models import load_causal_lm

    return load_causal_lm()


def test_generate_streams_what_the_library_generates(lm):
    r = run("generate", "The capital of France is", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    want = lm.generate("The capital of France is", max_new_tokens=12)
    assert r.stdout == "The capital of France is" + want.text + "\n"
    assert "12 tokens" in r.stderr and "tokens/s" in r.stderr


def test_generate_json_and_seeded_sampling(lm):
    args = ["generate", "Once upon a time", "--max-new-tokens", "8", "--temperature", "0.9", "--top-k", "50", "--top-p", "0.9", "--seed", "3", "--json"]
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    got = json.loads(a.stdout)
    assert got == {**json.loads(b.stdout), "timings": got["timings"]}  # the same text for the same seed
    want = lm.generate("Once upon a time", max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=3)
    assert got["token_ids"] == want.token_ids and got["text"] == want.text
    assert got["prompt_ids"] == lm.tokenizer.encode("Once upon a time")
    assert set(got["timings"]) >= {"prefill_s", "decode_s", "decode_tokens_per_s"}


@pytest.mark.parametrize(
    "args, match",
    [
        (["--top-p", "0"], r"--top-p should be in \(0, 1\], got 0.0"),
        (["--temperature", "-1"], "--temperature should be a finite number >= 0"),
        (["--max-new-tokens", "-2"], "--max-new-tokens should be >= 0, got -2"),
        (["--top-k", "0"], "--top-k should be >= 1, got 0"),
        (["--seed", "-1"], "--seed should be >= 0, got -1"),
        (["--model", "/no/such/model.gguf"], "/no/such/model.gguf: missing file"),
        ([""], "PROMPT is empty"),
    ],
)
def test_generate_errors_are_one_line(args, match):
    r = run("generate", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv: error:"), r.stderr
    assert __import__("re").search(match, lines[0]), lines[0]


def test_attention_of_a_decoder_draws_its_windows(tmp_path):
    from qkv.models import default_causal_lm_path

    text = "The river bank was quiet. " * 3
    r = run("attention", text, "--model", str(default_causal_lm_path()), "--layer", "5", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    png = tmp_path / "attention_layer5.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokens:" in r.stdout
