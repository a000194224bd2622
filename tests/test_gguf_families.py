"""GGUF files of every family qkv runs (llama, mistral as llama, qwen2, qwen3, gpt2), written as llama.cpp
lays them out (tests/gguf_writer.py, the gguf package's writer), read by qkv and by transformers' GGUF
loader (the oracle): logits, greedy text and tokenizers equal, quantized or not."""

import numpy as np
import pytest

import gguf_writer
from qkv.models import ModelError, load_causal_lm

TEXTS = ["", "The capital of France is Paris.", "  two spaces and\ttabs\n\nnewlines", "def add(a, b):\n    return a + b  # 12345",
         "Straße München café 日本語 😀", "<|im_start|>user\nhi<|im_end|>", "the cat sat on the mat"]  # fmt: skip


def _model(arch, torch, vocab_size, *, big=False, **over):
    """A random tiny transformers model; ``big``: rows of 256 and more, for K-quant blocks."""
    import transformers as tf

    E, F = (256, 512) if big else (32, 64)
    common = dict(vocab_size=vocab_size, hidden_size=E, intermediate_size=F, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=5000.0, tie_word_embeddings=False)
    elif arch == "mistral":  # llama.cpp writes Mistral as "llama"; the sliding window stays behind
        cfg = tf.MistralConfig(**common, tie_word_embeddings=False)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "qwen3":  # transformers' GGUF reader takes the head size from Qwen3's default: 128
        cfg = tf.Qwen3Config(**common, head_dim=128, tie_word_embeddings=False)
    elif arch == "gpt2":  # and GPT-2's context length from its default: 1024
        cfg = tf.GPT2Config(vocab_size=vocab_size, n_embd=E, n_layer=2, n_head=4, n_positions=1024)
    cfg.update(over)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # random norms and biases, so that one read wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def _hf_from_gguf(torch, path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}


@pytest.fixture(scope="module")
def bpe():
    return gguf_writer.byte_level_vocab()


@pytest.mark.parametrize("outtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("family", list(ARCH))
def test_gguf_family_equals_transformers(family, outtype, torch, tmp_path, bpe):
    model = _model(family, torch, len(bpe[0]))
    path = tmp_path / f"{family}-{outtype}.gguf"
    gguf_writer.write(model, path, arch=ARCH[family], outtype=outtype, vocab=bpe)
    lm = load_causal_lm(path)
    assert lm.config.family == ARCH[family] and lm.config.num_layers == 2
    hf = _hf_from_gguf(torch, path)
    ids = np.random.default_rng(0).integers(0, len(bpe[0]) - 3, size=(2, 14))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
        if outtype == "F32":  # the file is the model: transformers' reading of it gives the original back
            np.testing.assert_allclose(model(torch.tensor(ids)).logits.numpy(), want, atol=1e-5, rtol=0)
    got = lm(ids)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    prompt = ids[0, :5].tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert lm.generate(prompt, max_new_tokens=12, stop_at_eos=False).token_ids == ref


@pytest.mark.parametrize("scaling", [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                                     {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])  # fmt: skip
def test_gguf_llama_rope_scaling_equals_transformers(scaling, torch, tmp_path, bpe):
    """Llama 3.1's RoPE scaling as llama.cpp's files carry it (a rope_freqs.weight of divisors), and linear
    scaling (llama.rope.scaling.type and .factor), against transformers on the model itself (its GGUF
    reader reads neither). Refused before."""
    model = _model("llama", torch, len(bpe[0]), rope_parameters={"rope_theta": 500000.0, **scaling})
    path = tmp_path / "scaled.gguf"
    gguf_writer.write(model, path, arch="llama", vocab=bpe)
    lm = load_causal_lm(path)
    ids = np.random.default_rng(0).integers(0, len(bpe[0]) - 3, size=(2, 40))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(lm(ids), want, atol=1e-5, rtol=0)
    prompt = ids[0, :5].tolist()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert lm.generate(prompt, max_new_tokens=12, stop_at_eos=False).token_ids == ref
    plain = _model("llama", torch, len(bpe[0]), rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    with torch.no_grad():
        assert np.abs(plain(torch.tensor(ids)).logits.numpy() - want).max() > 1e-4  # (the same weights: the scaling shows)
    # quantized (Q8_0, the compiled decode step): the greedy tokens of its dequantized reference
    gguf_writer.write(model, tmp_path / "q8.gguf", arch="llama", outtype="Q8_0", vocab=bpe)
    q8, ref = load_causal_lm(tmp_path / "q8.gguf"), load_causal_lm(tmp_path / "q8.gguf", keep_quantized=False)
    np.testing.assert_allclose(q8(ids), ref(ids), atol=1e-4, rtol=0)
    assert q8.generate(prompt, max_new_tokens=12, stop_at_eos=False).token_ids == ref.generate(prompt, max_new_tokens=12, stop_at_eos=False).token_ids


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_gguf_kquant_family_equals_transformers(family, qtype, torch, tmp_path, bpe):
    model = _model(family, torch, len(bpe[0]), big=True)
    path = tmp_path / f"{family}-{qtype}.gguf"
    gguf_writer.write(model, path, arch=ARCH[family], outtype=qtype, vocab=bpe, rng=np.random.default_rng(1))
    lm = load_causal_lm(path)  # blocks kept: qkv's products decode them
    assert any(getattr(w, "qtype", None) == qtype for w in vars(lm.layers[0]).values())
    hf = _hf_from_gguf(torch, path)  # dequantized by the gguf package
    ids = np.random.default_rng(0).integers(0, len(bpe[0]) - 3, size=(1, 9))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got = lm(ids)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=2e-5 * max(1.0, scale), rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    np.testing.assert_allclose(load_causal_lm(path, keep_quantized=False)(ids), got, atol=2e-5 * max(1.0, scale), rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_gguf_byte_level_tokenizer_equals_transformers(arch, torch, tmp_path, bpe):
    from transformers import AutoTokenizer

    path = tmp_path / f"{arch}.gguf"
    gguf_writer.write(_model(arch, torch, len(bpe[0])), path, arch=arch, vocab=bpe)
    lm = load_causal_lm(path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = lm.tokenizer.encode(text, add_bos=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert lm.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert lm.tokenizer.token(lm.tokenizer.eos_id) == "<|endoftext|>"
    assert bpe[0].index("<|im_end|>") in lm.tokenizer.eos_ids  # a chat turn's end stops generation


@pytest.mark.parametrize("arch, spm, want", [("llama", False, True), ("qwen2", False, False), ("gpt2", False, False), ("llama", True, True)])
def test_without_an_add_bos_key_bos_follows_llama_cpps_defaults(arch, spm, want, torch, bpe, tmp_path):
    """No tokenizer.ggml.add_bos_token: llama.cpp (src/llama-vocab.cpp) adds BOS for SentencePiece
    vocabularies and for BPE split as Llama 3 splits (llama-bpe, llama3), not for Qwen's or GPT-2's."""
    vocab = gguf_writer.sentencepiece_vocab() if spm else bpe
    path = tmp_path / "m.gguf"
    gguf_writer.write(_model("llama" if arch == "llama" else arch, torch, len(vocab[0])), path, arch=arch, vocab=vocab, spm=spm, add_bos=None)
    tok = load_causal_lm(path).tokenizer
    assert tok.add_bos is want and (tok.encode("hi")[0] == tok.bos_id) is want


def test_gguf_sentencepiece_tokenizer_equals_transformers(torch, tmp_path):
    from transformers import AutoTokenizer

    vocab = gguf_writer.sentencepiece_vocab()
    path = tmp_path / "spm.gguf"
    gguf_writer.write(_model("llama", torch, len(vocab[0])), path, arch="llama", vocab=vocab, spm=True)
    lm = load_causal_lm(path)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert lm.tokenizer.bos_id == 1 and lm.tokenizer.add_bos
    for text in TEXTS:
        ids = lm.tokenizer.encode(text)
        assert ids == ref.encode(text), text
        assert lm.tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("seed", range(4))
def test_only_the_merges_bpe_can_make_are_kept_and_every_text_gets_the_same_tokens(seed):
    """A SentencePiece vocabulary's merges (every split of every entry) against the few of them that
    end an entry's own BPE (formats.tokenizer._merges_made): random vocabularies over three letters,
    where merges compete at every step, in random order, and random texts: the same tokens from the
    tokenizers library with all merges and with the kept ones. A merge that joins a byte or the
    unknown token (symbols not made from characters) keeps them all."""
    import tokenizers as tk

    from qkv.models.formats.tokenizer import _merges_made, _spm_merges

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "a", "b", "c"] + sorted({"".join(rng.choice(list("abc"), rng.integers(2, 7))) for _ in range(150)} | {"abc" * 30, "abc" * 30 + "a"})  # (two past _LONGEST_RUN)
    tail = tokens[4:]
    rng.shuffle(tail)  # the file's order is the merge order
    tokens[4:] = tail
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = [-i for i in range(len(tokens))]
    everything = _spm_merges(tokens, scores)
    kept = _merges_made(everything, vocab, "<unk>")
    assert set(kept) < set(everything) and kept == [m for m in everything if m in set(kept)]
    assert {m for m in everything if len(m[0] + m[1]) > 64} <= set(kept)  # a long entry's merges, all kept

    def bpe(merges):
        return tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True))

    texts = ["".join(rng.choice(list("abcd"), rng.integers(1, 40))) for _ in range(3000)]  # d: unknown
    texts += ["abc" * int(rng.integers(25, 35)) + "".join(rng.choice(list("abc"), 3)) for _ in range(50)]
    assert [e.ids for e in bpe(kept).encode_batch(texts)] == [e.ids for e in bpe(everything).encode_batch(texts)]
    for odd in ("<unk>", "<0x41>"):
        assert _merges_made(everything + [(odd, "a")], {**vocab, odd: 0, odd + "a": 1}, "<unk>") == everything + [(odd, "a")]


def test_gguf_chat_template_from_the_file(torch, tmp_path, bpe):
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    path = tmp_path / "chat.gguf"
    gguf_writer.write(_model("qwen2", torch, len(bpe[0])), path, arch="qwen2", vocab=bpe, chat_template=template)
    lm = load_causal_lm(path)
    assert lm.instruction_tuned
    text = lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert lm.tokenizer.encode(text, add_bos=False)[0] == bpe[0].index("<|im_start|>")  # a special token, whole


def test_gguf_family_errors(torch, tmp_path, bpe):
    model = _model("llama", torch, len(bpe[0]))
    path = tmp_path / "ok.gguf"
    gguf_writer.write(model, path, arch="llama", vocab=bpe)
    raw = path.read_bytes()
    # The data cut short: the tensor past the end is named.
    (tmp_path / "short.gguf").write_bytes(raw[: len(raw) - 4000])
    with pytest.raises(ModelError, match="truncated file: tensor"):
        load_causal_lm(tmp_path / "short.gguf")
    # An architecture qkv does not run.
    i = raw.find(b"llama", 0, 256)
    (tmp_path / "arch.gguf").write_bytes(raw[:i] + b"mamba" + raw[i + 5 :])
    with pytest.raises(ModelError, match="architecture 'mamba' is not supported"):
        load_causal_lm(tmp_path / "arch.gguf")
    # A quantization qkv does not read (Q2_K): the tensor and its type named, on either path.
    big = _model("llama", torch, len(bpe[0]), big=True)
    gguf_writer.write(big, tmp_path / "q2k.gguf", arch="llama", outtype="Q2_K", vocab=bpe, rng=np.random.default_rng(0))
    with pytest.raises(ModelError, match=r"q2k.gguf: tensor '.*' is Q2_K, which qkv does not keep quantized .* keep_quantized=False"):
        load_causal_lm(tmp_path / "q2k.gguf")
    # A byte-level vocabulary split by a rule qkv does not know.
    other = tmp_path / "pre.gguf"
    (other).write_bytes(raw.replace(b"llama-bpe", b"tekkenxyz", 1))
    with pytest.raises(ModelError, match="tokenizer.ggml.pre 'tekkenxyz' is not supported"):
        load_causal_lm(other)
    # RoPE scaling qkv does not run (YaRN on a llama file), and a rope_freqs.weight that is no divisor
    yarn = _model("llama", torch, len(bpe[0]), rope_parameters={"rope_theta": 500000.0, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128})
    gguf_writer.write(yarn, tmp_path / "yarn.gguf", arch="llama", vocab=bpe)
    with pytest.raises(ModelError, match="RoPE scaling 'yarn' is not supported"):
        load_causal_lm(tmp_path / "yarn.gguf")
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    gguf_writer.write(_model("llama", torch, len(bpe[0]), rope_parameters=rope), tmp_path / "l3.gguf", arch="llama", vocab=bpe)
    raw, factors = (tmp_path / "l3.gguf").read_bytes(), gguf_writer._llama3_rope_factors(8, rope)
    i = raw.rfind(factors.tobytes())
    (tmp_path / "bad.gguf").write_bytes(raw[:i] + np.zeros_like(factors).tobytes() + raw[i + factors.nbytes :])
    with pytest.raises(ModelError, match=r"tensor 'rope_freqs.weight' should hold numbers > 0, got 0.0"):
        load_causal_lm(tmp_path / "bad.gguf")


@pytest.mark.parametrize("value, shown", [(0.7, "0.699999988"), (float("nan"), "nan"), (-1.0, "-1.0")])
def test_a_token_id_in_the_metadata_is_an_integer_never_a_float_truncated(value, shown, torch, tmp_path, bpe):
    """tokenizer.ggml.bos_token_id stored as a float32: 0.7 had been read as token 0, silently, and NaN had
    failed in int() with a message that named nothing."""
    import struct

    path = tmp_path / "ok.gguf"
    gguf_writer.write(_model("llama", torch, len(bpe[0])), path, arch="llama", vocab=bpe)
    raw = path.read_bytes()
    key = b"tokenizer.ggml.bos_token_id"
    i = raw.index(key) + len(key)
    assert struct.unpack("<I", raw[i : i + 4])[0] == 4  # GGUF's UINT32, then the id
    (tmp_path / "f.gguf").write_bytes(raw[:i] + struct.pack("<If", 6, value) + raw[i + 8 :])  # FLOAT32
    with pytest.raises(ModelError, match=rf"f.gguf: tokenizer.ggml.bos_token_id should be a token id below {len(bpe[0])}, got {shown}"):
        load_causal_lm(tmp_path / "f.gguf")


@pytest.mark.parametrize("key, match", [("llama.rope.dimension_count", r"the head size \('llama.attention.key_length', else 'llama.rope.dimension_count'\) should be >= 1, got 0"),
                                        ("llama.attention.head_count", "metadata 'llama.attention.head_count' should be >= 1, got 0")])  # fmt: skip
def test_a_head_count_or_size_of_zero_is_named(key, match, torch, tmp_path, bpe):
    """A head size of 0 had failed in ``0 ** -0.5`` (a ZeroDivisionError) before the config's checks."""
    import struct

    path = tmp_path / "ok.gguf"
    gguf_writer.write(_model("llama", torch, len(bpe[0])), path, arch="llama", vocab=bpe)
    raw = path.read_bytes()
    i = raw.index(key.encode()) + len(key)
    assert struct.unpack("<I", raw[i : i + 4])[0] == 4  # UINT32
    (tmp_path / "z.gguf").write_bytes(raw[:i + 4] + struct.pack("<I", 0) + raw[i + 8 :])
    with pytest.raises(ModelError, match=match):
        load_causal_lm(tmp_path / "z.gguf")


def test_a_flag_in_the_metadata_is_true_or_false(torch, tmp_path, bpe):
    """tokenizer.ggml.add_bos_token stored as a UINT8: read by Python's truth before; llama.cpp refuses a
    key of the wrong type, and so does qkv, naming it."""
    import struct

    path = tmp_path / "ok.gguf"
    gguf_writer.write(_model("llama", torch, len(bpe[0])), path, arch="llama", vocab=bpe)
    raw = path.read_bytes()
    key = b"tokenizer.ggml.add_bos_token"
    i = raw.index(key) + len(key)
    assert struct.unpack("<IB", raw[i : i + 5]) == (7, 0)  # GGUF's BOOL, false (as converters write it for BPE)
    (tmp_path / "f.gguf").write_bytes(raw[:i] + struct.pack("<IB", 0, 2) + raw[i + 5 :])  # UINT8 2
    with pytest.raises(ModelError, match="f.gguf: tokenizer.ggml.add_bos_token should be true or false, got 2"):
        load_causal_lm(tmp_path / "f.gguf")


def test_gguf_quantized_weights_are_views_of_the_mapped_file(torch, tmp_path, bpe):
    """Kept blocks are read where the file has them (no copy: resident memory is the page cache's), and
    the mapping outlives the loader's closing of the file for as long as the model holds a matrix."""
    import gc
    import mmap

    path = tmp_path / "llama-Q8_0.gguf"
    gguf_writer.write(_model("llama", torch, len(bpe[0])), path, arch="llama", outtype="Q8_0", vocab=bpe)
    lm = load_causal_lm(path)
    gc.collect()
    w = lm.layers[0].w_down  # (the gate and up projections are joined into one copy, as are query, key and value)
    assert w.qtype == "Q8_0" and not w.raw.flags.owndata and not w.raw.flags.writeable
    base = w.raw
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    assert isinstance(base, mmap.mmap) and not base.closed
    ids = np.arange(7)[None]
    np.testing.assert_allclose(lm(ids), load_causal_lm(path, keep_quantized=False)(ids), atol=1e-4, rtol=0)


def test_a_tokenizer_read_from_the_cache_needs_no_token_string_decoded(torch, tmp_path, bpe, monkeypatch):
    """The cache is keyed on the vocabulary's bytes in the file: a second load decodes none of its
    strings (0.4 s for Gemma's 262,144) and encodes as the first; a file that differs by one token is
    another key, never the cached tokenizer of the first."""
    from qkv.models.formats import gguf as gguf_format

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_format, "_LAZY_STRINGS", 16)  # this small vocabulary held as a long one is
    tokens, merges, types = bpe
    path = tmp_path / "m.gguf"
    gguf_writer.write(_model("llama", torch, len(tokens)), path, arch="llama", vocab=bpe)
    first = load_causal_lm(path)  # built from the strings, then kept
    decoded = []
    real = gguf_format._Strings.decode
    monkeypatch.setattr(gguf_format._Strings, "decode", lambda self: decoded.append(self.key) or real(self))
    again = load_causal_lm(path)
    assert decoded == []
    for text in TEXTS:
        assert again.tokenizer.encode(text) == first.tokenizer.encode(text), text
    assert again.tokenizer.eos_ids == first.tokenizer.eos_ids and again.tokenizer.bos_id == first.tokenizer.bos_id

    a, b = tokens.index("a"), tokens.index("b")
    swapped = list(tokens)
    swapped[a], swapped[b] = "b", "a"
    other = tmp_path / "swapped.gguf"
    gguf_writer.write(_model("llama", torch, len(tokens)), other, arch="llama", vocab=(swapped, merges, types))
    lm = load_causal_lm(other)
    assert "tokenizer.ggml.tokens" in decoded  # not found in the cache: read and built
    assert first.tokenizer.encode("a", add_bos=False) == [a] and lm.tokenizer.encode("a", add_bos=False) == [b]


def test_cached_merges_are_kept_as_strings_only_where_no_piece_holds_a_space():
    """The cache writes BPE merges as "left right" strings (``tokenizers`` reads Gemma's that way in
    1.2 s against 1.9 as pairs): read back, the tokenizer encodes as the one it was made from; a merge
    with a space inside a piece keeps the pair form, which alone can say where the pieces part."""
    import json

    import tokenizers as tk

    from qkv.models.formats.tokenizer import _merges_as_strings

    vocab = {c: i for i, c in enumerate(["a", "b", "c", "ab", "abc", "ca", "cab"])}
    merges = [("a", "b"), ("ab", "c"), ("c", "a"), ("c", "ab")]
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges))
    text = _merges_as_strings(tok.to_str())
    assert json.loads(text)["model"]["merges"] == ["a b", "ab c", "c a", "c ab"]
    again = tk.Tokenizer.from_str(text)
    for s in ("abc", "cabab", "cacab", "bca", "abcabcab"):
        assert again.encode(s).ids == tok.encode(s).ids, s

    spaced = tk.Tokenizer(tk.models.BPE(vocab={"a": 0, "b": 1, " b": 2, "ab": 3, "a b": 4}, merges=[("a", "b"), ("a", " b")]))
    kept = spaced.to_str()
    assert _merges_as_strings(kept) == kept


def test_a_gguf_files_recommended_sampling_is_read_as_llama_cpp_reads_it(torch, tmp_path, bpe):
    """general.sampling.* (llama.cpp's converter writes them from generation_config.json; llama.cpp takes
    them as its defaults): float32 values read as written (0.95, not 0.949999988), those asking for
    nothing left out, llama.cpp's own samplers named as not followed, a bad value refused by name."""
    model = _model("llama", torch, len(bpe[0]))
    path = tmp_path / "m.gguf"
    meta = [("add_float32", "general.sampling.temp", 0.7), ("add_int32", "general.sampling.top_k", 20), ("add_float32", "general.sampling.top_p", 0.95),
            ("add_float32", "general.sampling.min_p", 0.0), ("add_float32", "general.sampling.penalty_repeat", 1.05), ("add_int32", "general.sampling.mirostat", 2)]  # fmt: skip
    gguf_writer.write(model, path, arch="llama", vocab=bpe, metadata=meta)
    got = load_causal_lm(path).sampling_defaults
    assert got.values == {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}, got
    assert got.ignored == ("mirostat=2",) and got.source == f"{path}: metadata"
    assert "temperature 0.7, top_k 20, top_p 0.95, repetition_penalty 1.05" in got.describe()
    gguf_writer.write(model, path, arch="llama", vocab=bpe)
    assert load_causal_lm(path).sampling_defaults.values == {}
    for bad, match in ((("add_float32", "general.sampling.top_p", 1.5), r"'general.sampling.top_p' should be in \(0, 1\], got 1.5"),
                       (("add_float32", "general.sampling.temp", float("nan")), "'general.sampling.temp' should be a finite number"),
                       (("add_string", "general.sampling.top_k", "40"), "'general.sampling.top_k' should be a finite number")):  # fmt: skip
        gguf_writer.write(model, path, arch="llama", vocab=bpe, metadata=[bad])
        with pytest.raises(ModelError, match=match):
            load_causal_lm(path)
