"""The command line, run as a user runs it: a subprocess."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from qkv import Embedding, MultiHeadAttention, Vocabulary, sinusoidal_position_encoding, tokenize


def run(*args, cwd=None, env=None, input=None):
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120, input=input)


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
        (["demo", "   "], "TEXT is empty: give some text"),
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


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_output_a_terminal_cannot_encode_is_escaped_not_an_error(encoding):
    # A locale or PYTHONIOENCODING without these characters: the output comes, with escapes for them.
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    r = subprocess.run([sys.executable, "-m", "qkv", "demo", "Der Bär schläft 日本", "--no-plots", "--heads", "1", "--dim", "2"], capture_output=True, timeout=120, env=env)
    out = r.stdout.decode(encoding)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert "head 0" in out and "\\u65e5\\u672c" in out
    assert ("Bär" if encoding == "latin-1" else "B\\xe4r") in out


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
    r = run("demo", "--model", "minilm", "--format", "json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    bank = [p for p in got["repeated_words"] if p["word"] == "bank"][0]
    assert bank["static_cosine"] > 0.9999 and bank["contextual_cosine"] < 0.9
    assert (tmp_path / "embeddings_pca_model.png").stat().st_size > 10_000


def test_model_errors_are_one_line(tmp_path):
    r = run("embed", "hello", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.strip() == f"qkv: error: --model '{tmp_path / 'missing'}' is neither 'minilm' nor an existing path (--model takes a value; TEXT goes before it)"
    (tmp_path / "empty").mkdir()
    r = run("embed", "hello", "--model", str(tmp_path / "empty"))
    assert r.returncode == 2 and r.stderr.strip() == f"qkv: error: {tmp_path / 'empty' / 'config.json'}: missing file"


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


def test_generate_with_int8_activations_is_the_library_under_the_switch(lm):
    from qkv.models.formats.quants import int8_activations

    r = run("generate", "The capital of France is", "--max-new-tokens", "16", "--int8-activations", "--json")
    assert r.returncode == 0, r.stderr
    with int8_activations():
        want = lm.generate("The capital of France is", max_new_tokens=16)
    assert json.loads(r.stdout)["token_ids"] == want.token_ids


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
        (["--top-p", "0", "--temperature", "1"], r"--top-p should be in \(0, 1\], got 0.0"),
        (["--temperature", "-1"], "--temperature should be a finite number >= 0"),
        (["--max-new-tokens", "-2"], "--max-new-tokens should be >= 0, got -2"),
        (["--top-k", "0", "--temperature", "1"], "--top-k should be >= 1, got 0"),
        (["--seed", "-1", "--temperature", "1"], "--seed should be >= 0, got -1"),
        (["--model", "/no/such/model.gguf"], "--model '/no/such/model.gguf' is neither 'gemma3-270m' nor an existing path"),
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


def test_attention_refuses_a_text_whose_weights_would_not_fit_before_running(tmp_path):
    """Every layer's weights come back at once, L**2 a head: 3,001 tokens of Gemma 3 270M had held 6.8 GB."""
    from qkv.cli.attention import MAX_WEIGHT_BYTES

    text = " ".join(["word"] * 3000)  # 3,001 tokens with BOS: 18 layers x 4 heads x 3,001**2 x 4 bytes
    need = 18 * 4 * 3001**2 * 4
    assert need > MAX_WEIGHT_BYTES
    r = run("attention", "-", "--model", "gemma3-270m", "--out", str(tmp_path), input=text)
    assert r.returncode == 2 and f"3,001 tokens: the model's attention weights would take {need / 2**30:.1f} GiB" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())  # nothing drawn


# ------------------------------------------------------------------ first contact (a newcomer's session)
def test_model_takes_a_value_and_a_sentence_is_not_a_model(tmp_path):
    r = run("demo", "--model", "I sat on the bank", "--out", str(tmp_path))
    assert r.returncode == 2 and "is neither 'minilm' nor an existing path (--model takes a value; TEXT goes before it)" in r.stderr
    r = run("demo", "--model", " ".join(["word"] * 300), "--no-plots")
    assert r.returncode == 2 and "File name too long" not in r.stderr and "--model 'word word" in r.stderr
    r = run("demo", "--model", "", "--no-plots")
    assert r.returncode == 2 and "--model is empty" in r.stderr
    r = run("demo", "--model")
    assert r.returncode == 2 and "expected one argument" in r.stderr


@pytest.mark.parametrize("option", [["--heads", "8"], ["--causal"], ["--seed", "3"], ["--dim", "16"], ["--full"]])
def test_options_a_mode_ignores_are_refused(option):
    r = run("demo", "--model", "minilm", *option, "--no-plots")
    assert r.returncode == 2
    assert f"{option[0]} has no effect with --model" in r.stderr


@pytest.mark.parametrize(
    "args, match",
    [
        (["demo", "--no-plots", "--out", "x"], "--out has no effect with --no-plots"),
        (["demo", "--full", "--format", "json", "--no-plots"], "--full has no effect with --format json"),
        (["generate", "--top-k", "5"], "--top-k has no effect with --temperature 0"),
        (["generate", "--top-p", "0.9"], "--top-p has no effect with --temperature 0"),
        (["generate", "--seed", "1"], "--seed has no effect with --temperature 0"),
    ],
)
def test_other_ignored_options_are_refused(args, match):
    r = run(*args)
    assert r.returncode == 2 and match in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args, match",
    [
        (["--seed", "-1"], "--seed should be >= 0, got -1"),
        (["--dim", "0"], "--dim should be >= 1, got 0"),
        (["--heads", "0"], "--heads should be >= 1, got 0"),
        (["--dim", "100000", "--heads", "1"], r"MultiHeadAttention of embed_dim 100000 needs [\d.]+ GiB, more than this machine's"),
    ],
)
def test_demo_errors_name_the_option_and_never_trace(args, match):
    r = run("demo", *args, "--no-plots")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert __import__("re").search(match, lines[0]), lines[0]


def test_one_rule_for_empty_text():
    for args in (["demo", ""], ["demo", "   "], ["embed", ""], ["embed", "fine", " "], ["attention", ""], ["generate", ""]):
        r = run(*args)
        assert r.returncode == 2, args
        assert "is empty: give some text" in r.stderr, (args, r.stderr)


def test_non_utf8_arguments_are_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "qkv", "demo", b"caf\xe9 au lait", "--no-plots"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "TEXT is not valid UTF-8 (byte 0xe9 at character 3)" in r.stderr and "Traceback" not in r.stderr


def test_long_text_output_is_proportionate_and_tables_align():
    words = ("because attention weighs every other word " * 50).split()[:300]
    r = run("demo", " ".join(words), "--no-plots")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) < 20_000 and "--full prints every weight" in r.stdout
    short = run("demo", "the cat sat because 日本語 was ok.", "--causal", "--no-plots")
    tables = [block.strip("\n").splitlines()[1:] for block in short.stdout.split("\nhead ")[1:]]
    assert len(tables) == 4 and all(len(t) == 1 + 8 for t in tables)  # header + 8 token rows
    from qkv.cli.common import _width

    for lines in tables:
        widths = {_width(line) for line in lines}
        assert len(widths) == 1, lines  # every row of a table as wide as its header
    assert "because" in short.stdout and "becau~" not in short.stdout
    assert "--" in short.stdout and "('--' = masked)" in short.stdout


def test_out_never_writes_through_a_symlink(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "attention.png").symlink_to(target)
    r = run("demo", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert target.read_text() == "keep me"
    png = out / "attention.png"
    assert not png.is_symlink() and png.read_bytes()[:4] == b"\x89PNG"
    assert not list(out.glob(".*.tmp"))


def test_ctrl_c_is_one_line_and_death_by_sigint(interruptible):
    import signal
    import time

    with subprocess.Popen([sys.executable, "-m", "qkv", "generate", "Once upon a time", "--max-new-tokens", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not p.stdout.read(1):
            pass  # wait until it prints: the model is loaded and generating
        p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(timeout=20)
        finally:
            p.kill()
        err = p.stderr.read()
    assert rc == -signal.SIGINT  # a shell reports 130
    assert err.strip().splitlines()[-1] == "qkv: interrupted" and "Traceback" not in err


@pytest.mark.parametrize("launch", ["-c", "-m"])
@pytest.mark.parametrize("how", ["raise KeyboardInterrupt", "exec('raise KeyboardInterrupt')"])
def test_the_status_after_ctrl_c_does_not_depend_on_where_it_landed(how, launch, tmp_path):
    # Under `python -m`, CPython ends the process by SIGINT whatever status it exits with once a
    # KeyboardInterrupt has gone through an exec() of a string, even one caught later (a lazy import,
    # a dataclass being made when Ctrl-C comes). qkv's program ends that way after every Ctrl-C.
    import signal

    (tmp_path / "stopper").mkdir()
    (tmp_path / "stopper" / "__main__.py").write_text(
        "import atexit, sys, qkv.cli as cli\n"
        "atexit.register(lambda: print('shut down', file=sys.stderr))\n"
        "def stop(args):\n"
        "    print('partial output', end='')\n"
        f"    {how}\n"
        "cli.cmd_demo = stop\n"
        "cli.run()\n"
    )
    target = (tmp_path / "stopper" / "__main__.py").read_text() if launch == "-c" else "stopper"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, launch, target, "demo"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == -signal.SIGINT  # what a shell reports as 130
    assert r.stdout == "partial output"  # flushed: the process shut down as usual first
    assert r.stderr.strip().splitlines() == ["qkv: interrupted", "shut down"]


def test_main_returns_the_interrupted_status_to_python_callers(monkeypatch, capsys):
    import qkv.cli as cli

    def stop(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_demo", stop)
    assert cli.main(["demo"]) == cli.INTERRUPTED == 130
    assert capsys.readouterr().err.strip() == "qkv: interrupted"


@pytest.mark.parametrize("words", [1025, 6000, 20_000])
def test_the_demo_is_bounded_before_it_works(words):
    """6,000 words once took 7.4 GB and 2 minutes: a text past the demo's bound is one line, at once."""
    r = run("demo", " ".join(["word"] * words), "--no-plots")  # an argument of at most 128 KiB (Linux)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"qkv: error: TEXT has {words:,} tokens") and "give at most 1,024 tokens" in r.stderr
    r = run("demo", " ".join(["word"] * 1024), "--no-plots", "--format", "json")
    assert r.returncode == 0 and len(json.loads(r.stdout)["tokens"]) == 1024
