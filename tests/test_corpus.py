"""Embedding a corpus on one machine: streaming into a .npy, order, resume, search, the CLI."""

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from qkv.models import Index, embed_file, iter_texts, load_model


@pytest.fixture(scope="module")
def encoder():
    return load_model()


def corpus_lines():
    lines = ["The river bank was steep.", "", "I deposited cash at the bank.", "The river bank was steep.", "  ", "café au lait", "long " * 400, "a cat", "dogs bark", ""]
    return lines * 7  # 70 lines: several chunks with chunk size 2 x 4


def blank_rows_zero(lines, vectors):
    """What a corpus run writes: blank lines have no meaning to embed and get rows of zeros."""
    vectors = np.array(vectors)
    vectors[[i for i, t in enumerate(lines) if not t.strip()]] = 0
    return vectors


def write(tmp_path, lines, name="corpus.txt"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_row_i_is_line_i_with_empty_duplicate_and_long_lines(encoder, tmp_path):
    lines = corpus_lines()
    src = write(tmp_path, lines)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = embed_file(encoder, src, tmp_path / "e.npy", batch_size=4, chunk_batches=2)
    cut = [w for w in caught if "truncated" in str(w.message)]
    assert len(cut) == 1 and str(cut[0].message).startswith("7 texts were longer than max_seq_length=256")  # once, not per line
    got = np.load(tmp_path / "e.npy")
    assert got.shape == (70, 384) and got.dtype == np.float32 and res["rows"] == 70
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = blank_rows_zero(lines, encoder.encode(lines))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not got[1].any() and not got[4].any()  # "" and "  "
    np.testing.assert_allclose(got[0], got[3], atol=1e-6)  # duplicate lines: the same row (to rounding: other batches)
    assert not (tmp_path / "e.npy.progress.json").exists()


@pytest.mark.filterwarnings("ignore:.* texts were longer than max_seq_length")
def test_an_interrupted_run_resumes_bit_for_bit(encoder, tmp_path):
    src = write(tmp_path, corpus_lines())
    embed_file(encoder, src, tmp_path / "full.npy", batch_size=4, chunk_batches=2)

    def stop(rows):
        if rows >= 24:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        embed_file(encoder, src, tmp_path / "part.npy", batch_size=4, chunk_batches=2, on_chunk=stop)
    assert json.loads((tmp_path / "part.npy.progress.json").read_text())["rows"] == 24
    res = embed_file(encoder, src, tmp_path / "part.npy", batch_size=4, chunk_batches=2, resume=True)
    assert res["resumed_from"] == 24
    np.testing.assert_array_equal(np.load(tmp_path / "part.npy"), np.load(tmp_path / "full.npy"))
    with pytest.raises(ValueError, match="nothing to resume"):
        embed_file(encoder, src, tmp_path / "part.npy", resume=True)


@pytest.mark.filterwarnings("ignore:.* texts were longer than max_seq_length")
def test_resume_refuses_a_changed_input(encoder, tmp_path):
    src = write(tmp_path, corpus_lines())
    with pytest.raises(KeyboardInterrupt):
        embed_file(encoder, src, tmp_path / "p.npy", batch_size=4, chunk_batches=2, on_chunk=lambda rows: (_ for _ in ()).throw(KeyboardInterrupt()))
    write(tmp_path, corpus_lines()[:-1])
    with pytest.raises(ValueError, match=r"cannot resume .*p\.npy: size, mtime_ns, lines changed"):
        embed_file(encoder, src, tmp_path / "p.npy", batch_size=4, chunk_batches=2, resume=True)


def test_bad_bytes_and_jsonl(encoder, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\nalso fine\ncaf\xe9\n")
    with pytest.raises(ValueError, match=r"bad.txt: line 3 is not valid UTF-8 \(byte 0xe9 at byte 3 of the line\)"):
        list(iter_texts(bad))
    assert list(iter_texts(bad, errors="replace"))[2] == "caf\ufffd"
    js = tmp_path / "c.jsonl"
    js.write_text('{"text": "a cat"}\n{"body": "x", "text": ""}\n{"text": "dogs bark"}\n')
    embed_file(encoder, js, tmp_path / "j.npy", format="jsonl")
    np.testing.assert_allclose(np.load(tmp_path / "j.npy"), blank_rows_zero(["a cat", "", "dogs bark"], encoder.encode(["a cat", "", "dogs bark"])), atol=1e-6)
    js.write_text('{"text": "a"}\n{"title": "b"}\n')
    with pytest.raises(ValueError, match="line 2 has no string field 'text'"):
        list(iter_texts(js, format="jsonl"))
    js.write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")  # had been a RecursionError
    with pytest.raises(ValueError, match="c.jsonl: line 2 nests JSON deeper than Python's parser goes"):
        list(iter_texts(js, format="jsonl"))


def test_index_search_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((1000, 16)).astype(np.float32)
    np.save(tmp_path / "v.npy", vectors)
    index = Index(tmp_path / "v.npy", block_rows=128)  # many blocks
    q = rng.standard_normal(16)
    rows, scores = index.search(q, k=7)
    cos = vectors.astype(np.float64) @ q / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(q))
    want = np.argsort(-cos, kind="stable")[:7]
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_allclose(scores, cos[want], rtol=1e-5)
    assert Index(tmp_path / "v.npy").search(q, k=5000)[0].shape == (1000,)
    with pytest.raises(ValueError, match=r"query shape should be \(16,\) or \(Q, 16\)"):
        index.search(np.ones(3))
    with pytest.raises(ValueError, match="k should be >= 1"):
        index.search(q, k=0)
    # Several queries in one pass: each row as if searched alone.
    qs = rng.standard_normal((5, 16))
    rows5, scores5 = index.search(qs, k=7)
    assert rows5.shape == scores5.shape == (5, 7)
    for i in range(5):
        r, sc = index.search(qs[i], k=7)
        np.testing.assert_array_equal(rows5[i], r)
        np.testing.assert_allclose(scores5[i], sc, rtol=1e-6)  # one GEMM or one matrix-vector product: rounding apart
    np.testing.assert_allclose(index.norms(), np.linalg.norm(vectors, axis=1), rtol=1e-6)


def test_index_ties_go_to_the_earlier_row(tmp_path):
    v = np.tile(np.array([[1, 0], [0, 1]], np.float32), (300, 1))  # 600 rows: equal pairs across blocks
    np.save(tmp_path / "t.npy", v)
    rows, scores = Index(tmp_path / "t.npy", block_rows=64).search(np.array([1.0, 0.0]), k=4)
    np.testing.assert_array_equal(rows, [0, 2, 4, 6])
    np.testing.assert_array_equal(scores, [1, 1, 1, 1])


@pytest.mark.parametrize("seed", range(4))
def test_index_ties_go_to_the_earlier_row_whatever_the_partition_picks(seed, tmp_path):
    """Rows of a few directions, so that many rows tie at every rank and within every block: the k best
    are those of a stable sort by each row's direction (the earlier row first), whatever the blocks and
    k, and NaN scores rank last. (NumPy 1.26's partition picked later tied rows.) The ties are exact
    whatever order BLAS sums in: small integers, scaled by powers of two, against queries of norm 2."""
    from qkv.models.corpus.index import _best_columns

    rng = np.random.default_rng(seed)
    # one norm for every direction (signed permutations of one vector): equal cosines are equal dot products
    directions = np.array([rng.permutation([2, 1, 1, 0, 0, 0, 0, 0]) * rng.choice([-1, 1], 8) for _ in range(5)], np.float32)
    which = rng.integers(0, 5, 700)
    v = directions[which] * rng.choice([1.0, 2.0, 4.0], (700, 1)).astype(np.float32)  # the same cosine, other norms
    blank = rng.integers(0, 700, 20)
    v[blank] = 0  # blank lines: never results
    np.save(tmp_path / "t.npy", v)
    q = np.zeros((3, 8), np.float32)
    q[0, :4], q[1, 4:], q[2, ::2] = 1, 1, (1, -1, 1, -1)  # norm 2: each query's halves are exact
    for block_rows in (64, 100, 700):
        index = Index(tmp_path / "t.npy", block_rows=block_rows)
        for k in (1, 3, 17, 90):
            rows, _ = index.search(q, k=k)
            for i in range(len(q)):
                rank = np.where(np.isin(np.arange(700), blank), -np.inf, (directions @ q[i])[which])
                want = np.argsort(-rank, kind="stable")[:k]
                np.testing.assert_array_equal(rows[i], want, err_msg=f"block_rows={block_rows} k={k} query {i}")
    s = rng.integers(0, 3, (6, 50)).astype(np.float32)  # ties at every k
    s[0, :4] = np.nan
    for k in range(1, 50):
        key = np.where(np.isnan(s), -np.inf, s)
        want = np.sort(np.argsort(-key, axis=1, kind="stable")[:, :k], axis=1)
        np.testing.assert_array_equal(_best_columns(s, k), want)


@pytest.mark.parametrize("damage", ["python2 header", "no columns", "objects"])
def test_a_damaged_or_foreign_npy_is_a_value_error_naming_it(damage, tmp_path):
    """np.load's own errors are not all ValueErrors: a header it cannot parse falls back to a Python 2
    reading that raises tokenize's TokenError."""
    p = tmp_path / "e.npy"
    if damage == "objects":
        np.save(p, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    else:
        np.save(p, np.zeros((4, 0 if damage == "no columns" else 3), np.float32))
        if damage == "python2 header":
            raw = bytearray(p.read_bytes())
            raw[10:14] = b"(((("  # the header's dict opened by unclosed brackets
            p.write_bytes(raw)
    with pytest.raises(ValueError, match=f"{p}"):
        Index(p).search(np.ones(3, np.float32), k=1)


def test_embed_and_search_commands(tmp_path):
    lines = ["The river bank was steep.", "I deposited cash at the bank.", "", "Dogs bark at night.", "The stock market fell."]
    src = write(tmp_path, lines)
    run = lambda *a: subprocess.run([sys.executable, "-m", "qkv", *a], capture_output=True, text=True, cwd=tmp_path, timeout=120)  # noqa: E731
    r = run("embed", "--input", str(src), "--output", "idx.npy")
    assert r.returncode == 0, r.stderr
    assert "wrote idx.npy: 5 x 384 float32 embeddings" in r.stderr and r.stdout == ""
    r = run("search", "money in a bank account", "--index", "idx.npy", "--texts", str(src), "-k", "2", "--json")
    got = json.loads(r.stdout)
    assert got["results"][0]["row"] == 1 and got["results"][0]["text"] == lines[1]
    r = subprocess.run([sys.executable, "-m", "qkv", "embed", "--input", "-", "--output", "stdin.npy"], input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "stdin.npy"), np.load(tmp_path / "idx.npy"))
    for args, message in (
        (["embed", "--input", str(src)], "--input needs --output FILE.npy"),
        (["embed", "a", "--input", str(src), "--output", "x.npy"], "give TEXT arguments or --input, not both"),
        (["embed"], "give TEXT arguments, or --input FILE"),
        (["embed", "a", "--resume"], "--resume has no effect without --input"),
        (["embed", "a", "--workers", "0"], "--workers has no effect without --input"),  # (0 had passed: 0 == False)
        (["embed", "a", "--batch-size", "-1"], "--batch-size should be in [1, 4096], got -1"),  # (had been ignored without --input)
        (["embed", "--input", str(src), "--output", "x.npy", "--batch-size", str(10**20)], "--batch-size should be in [1, 4096], got 100000000000000000000"),
        (["search", "q", "--index", "missing.npy"], "--index 'missing.npy' is not a file"),
    ):
        r = run(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_batch_sizes_are_checked_everywhere(encoder, tmp_path):
    """A batch size is an integer in [1, MAX_BATCH_SIZE]: 10**20 had made one batch of a whole corpus
    (embed_file then reads the whole file into memory), 1.5 had failed inside range()."""
    from qkv.models.engines.encoder import MAX_BATCH_SIZE

    src = write(tmp_path, ["a", "b"])
    for bad, error in ((0, ValueError), (MAX_BATCH_SIZE + 1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="batch_size should be"):
            encoder.encode(["a"], batch_size=bad)
        with pytest.raises(error, match="batch_size should be"):
            embed_file(encoder, src, tmp_path / "x.npy", batch_size=bad)
    with pytest.raises(TypeError, match="chunk_batches should be an integer, got float"):
        embed_file(encoder, src, tmp_path / "x.npy", chunk_batches=2.5)
    one, two = encoder.encode(["a", "bb", "c c c"], batch_size=1), encoder.encode(["a", "bb", "c c c"], batch_size=MAX_BATCH_SIZE)
    np.testing.assert_allclose(one, two, rtol=0, atol=1e-5)


def test_streamed_embeddings_equal_sentence_transformers(encoder, tmp_path):
    from sentence_transformers import SentenceTransformer

    from qkv.models import default_model_dir

    lines = ["The river bank was steep.", "", "I deposited cash at the bank.", "café au lait", "Dogs bark at night."]
    embed_file(encoder, write(tmp_path, lines), tmp_path / "s.npy")
    ref = blank_rows_zero(lines, SentenceTransformer(str(default_model_dir()), device="cpu").encode(lines, convert_to_numpy=True))
    np.testing.assert_allclose(np.load(tmp_path / "s.npy"), ref, rtol=0, atol=1e-5)


def test_qkv_embed_killed_mid_run_resumes_bit_for_bit(tmp_path):
    """SIGKILL a real `qkv embed --input` process after its first chunks; `--resume` ends equal to a clean run."""
    import os
    import signal
    import time

    rng = np.random.default_rng(3)
    words = "the a river bank cash deposit steep dog cat market fell rose night morning".split()
    lines = [" ".join(rng.choice(words, size=int(rng.integers(0, 9)))) for _ in range(600)]  # empty lines too
    src = write(tmp_path, lines)
    cmd = [sys.executable, "-m", "qkv", "embed", "--input", str(src), "--batch-size", "4", "--quiet"]  # chunks of 64 lines
    full = subprocess.run([*cmd, "--output", "full.npy"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert full.returncode == 0, full.stderr
    marker = tmp_path / "part.npy.progress.json"
    proc = subprocess.Popen([*cmd, "--output", "part.npy"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    rows = 0
    while rows < 128 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
        try:
            rows = json.loads(marker.read_text())["rows"]
        except (FileNotFoundError, json.JSONDecodeError):
            pass
    assert proc.poll() is None, "the run ended before it could be killed: make the corpus longer"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    killed_at = json.loads(marker.read_text())["rows"]
    assert 128 <= killed_at < len(lines)
    resumed = subprocess.run([*cmd, "--output", "part.npy", "--resume"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at row {killed_at}" in resumed.stderr, resumed.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "part.npy"), np.load(tmp_path / "full.npy"))
    assert not marker.exists()
