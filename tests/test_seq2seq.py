"""Encoder-decoder models against transformers (the oracle): random tiny T5 models built by transformers
from a config, saved as a directory, loaded by qkv: encoder output, logits, cross-attention weights,
greedy and beam search outputs."""

import dataclasses
import json

import numpy as np
import pytest

from qkv.models import ModelError, load_seq2seq_lm
from qkv.models.engines.seq2seq import t5_buckets

V = 64


def _tiny_t5(torch, tmp_path, kind="t5", decoder_layers=3, eos_gain=1.0):
    import transformers as tf

    gated = kind == "flan"
    cfg = tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=decoder_layers, num_heads=4, relative_attention_num_buckets=16,
                      relative_attention_max_distance=20, feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=not gated,
                      decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, initializer_factor=0.5)  # fmt: skip
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration._from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        # transformers' own init makes a tiny model repeat one token whatever the source. Instead: norms
        # random around 1 (one applied wrongly shows), embeddings of equal norm (no token wins every
        # step), strong attention and MLP outputs (the next token depends on the source and the past).
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.copy_(1 + torch.randn_like(p) * 0.3)
            elif "relative_attention_bias" in name:
                p.normal_(0, 1.0)
            elif name in ("shared.weight", "lm_head.weight"):
                p.normal_(0, 1.0)
                p.mul_(4 / p.norm(dim=1, keepdim=True))
            elif name.endswith(("o.weight", "wo.weight")):
                p.normal_(0, 3 / p.shape[1] ** 0.5)
            elif p.ndim == 2:
                p.normal_(0, 1 / p.shape[1] ** 0.5)
    if gated:  # flan-t5's checkpoints: an lm_head of its own, no output scaling
        head = torch.randn_like(model.lm_head.weight)
        model.lm_head.weight = torch.nn.Parameter(head * 4 / head.norm(dim=1, keepdim=True))
        model.config.scale_decoder_outputs = False
    with torch.no_grad():  # eos_gain > 1: EOS likelier, so that beams finish at different lengths
        (model.lm_head.weight if gated else model.shared.weight)[1] *= eos_gain
    d = tmp_path / kind
    model.save_pretrained(d, safe_serialization=True)
    if gated:  # as flan-t5's config.json says it
        c = json.loads((d / "config.json").read_text())
        c["tie_word_embeddings"] = False
        c["scale_decoder_outputs"] = False
        (d / "config.json").write_text(json.dumps(c))
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}, str(d / "model.safetensors"))
    return model, d


def test_buckets_equal_transformers(torch):
    from transformers.models.t5.modeling_t5 import T5Attention

    q, k = np.arange(300), np.arange(300)
    rel = torch.tensor(k[None, :] - q[:, None])
    for bidirectional in (True, False):
        for buckets, dist in ((32, 128), (16, 20)):
            want = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=buckets, max_distance=dist).numpy()
            np.testing.assert_array_equal(t5_buckets(q, k, bidirectional=bidirectional, num_buckets=buckets, max_distance=dist), want)


@pytest.mark.parametrize("kind", ["t5", "flan"])
def test_t5_equals_transformers(kind, torch, tmp_path):
    model, d = _tiny_t5(torch, tmp_path, kind)
    lm = load_seq2seq_lm(d)
    assert lm.config.gated_ffn == (kind == "flan") and (lm.lm_head is lm.embed) == (kind == "t5")
    rng = np.random.default_rng(0)
    src = rng.integers(2, V, size=(2, 13))
    dec = np.concatenate([np.zeros((2, 1), int), rng.integers(2, V, size=(2, 9))], axis=1)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(src), decoder_input_ids=torch.tensor(dec), output_attentions=True)
    out = lm.forward(src, dec, output_attentions=True)
    assert out.logits.dtype == np.float32
    np.testing.assert_allclose(out.encoder_hidden, ref.encoder_last_hidden_state.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(out.logits, ref.logits.numpy(), atol=1e-4, rtol=0)
    assert (len(ref.encoder_attentions), len(ref.decoder_attentions), len(ref.cross_attentions)) == (2, 3, 3)  # every layer's, compared below
    for mine, theirs in zip(out.encoder_attentions + out.decoder_attentions + out.cross_attentions, ref.encoder_attentions + ref.decoder_attentions + ref.cross_attentions):
        np.testing.assert_allclose(mine, theirs.numpy(), atol=1e-5, rtol=0)
    assert out.cross_attentions[0].shape == (2, 4, 10, 13)  # (B, H, T, S): every target token over the source


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("kind", ["t5", "flan"])
def test_t5_greedy_and_beam_search_equal_generate(kind, num_beams, torch, tmp_path):
    model, d = _tiny_t5(torch, tmp_path, kind, decoder_layers=2)  # transformers' generate sizes its cache by num_layers
    lm = load_seq2seq_lm(d)
    rng = np.random.default_rng(1)
    varied = 0
    for _ in range(12):
        src = rng.integers(2, V, size=int(rng.integers(4, 14))).tolist() + [1]
        with torch.no_grad():
            ref = model.generate(torch.tensor([src]), max_new_tokens=12, num_beams=num_beams, do_sample=False)[0, 1:].tolist()
        got = lm.generate(src, max_new_tokens=12, num_beams=num_beams).token_ids
        assert got == ref[: len(got)] and all(t == 0 for t in ref[len(got) :]), (src, got, ref)  # transformers pads finished beams
        varied += len(set(got)) >= 3
    assert varied >= 3  # not all degenerate repeats: the comparison means something


def test_t5_cache_equals_the_full_pass(torch, tmp_path):
    _, d = _tiny_t5(torch, tmp_path)
    lm = load_seq2seq_lm(d)
    rng = np.random.default_rng(2)
    src, dec = rng.integers(2, V, size=(1, 9)), rng.integers(2, V, size=(1, 8))
    full = lm.forward(src, dec).logits
    cache = lm.new_cache(lm.encode(src))
    steps = [lm.decode(dec[:, :3], cache)] + [lm.decode(dec[:, t : t + 1], cache) for t in range(3, 8)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)
    assert len(cache) == 8 and cache.cross_kv[0][0].shape == (1, 4, 9, 8)  # the source's keys, computed once


def test_seq2seq_errors(torch, tmp_path):
    _, d = _tiny_t5(torch, tmp_path)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "model_type": "pegasus"}))
    with pytest.raises(ModelError, match="model_type 'pegasus' is not a supported encoder-decoder; supported: \\['t5', 'bart', 'marian', 'whisper'\\]"):
        load_seq2seq_lm(d)
    (d / "config.json").write_text(json.dumps(c))
    lm = load_seq2seq_lm(d)
    with pytest.raises(ValueError, match=r"source should lie in \[0, 63\], got \[64\]"):
        lm.generate([5, 64])
    with pytest.raises(ValueError, match="num_beams should be >= 1"):
        lm.generate([5, 6], num_beams=0)
    with pytest.raises(TypeError, match="input_ids should be integers, got dtype float64"):
        lm.encode([1.5, 2.0])
    with pytest.raises(ModelError, match="an encoder-decoder model is a Hugging Face directory"):
        load_seq2seq_lm(d / "config.json")


@pytest.mark.parametrize("kind", ["t5", "flan"])
def test_beam_search_finishing_at_eos_equals_generate(kind, torch, tmp_path):
    """EOS made likelier, so that hypotheses finish at different lengths: the length penalty and both
    stopping rules decide which one wins, as in transformers."""
    model, d = _tiny_t5(torch, tmp_path, kind, decoder_layers=2, eos_gain=1.5)
    lm = load_seq2seq_lm(d)
    rng = np.random.default_rng(1)
    reasons, lengths = set(), set()
    for _ in range(8):
        src = rng.integers(2, V, size=int(rng.integers(4, 14))).tolist() + [1]
        for length_penalty, early_stopping in ((1.0, False), (0.5, True), (2.0, False), (2.0, "never"), (-1.0, "never")):
            out = lm.generate(src, max_new_tokens=12, num_beams=4, length_penalty=length_penalty, early_stopping=early_stopping)
            with torch.no_grad():
                ref = model.generate(torch.tensor([src]), max_new_tokens=12, num_beams=4, length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False)[0, 1:].tolist()
            got = out.token_ids
            assert got == ref[: len(got)] and all(t == 0 for t in ref[len(got) :]), (src, length_penalty, early_stopping, got, ref)
            reasons.add(out.stop_reason)
            lengths.add(len(got))
    assert reasons == {"eos", "length"} and len(lengths) >= 3  # the cases the rules are about did occur


# ------------------------------------------------------------------ BART and Marian


def _tiny_bart(family, torch, tmp_path, gain=2.0, spread=1.0, activation="swish", scale_embedding=False):
    import transformers as tf

    common = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2)  # fmt: skip
    if family == "bart":
        cfg = tf.BartConfig(**common, decoder_start_token_id=2, forced_eos_token_id=2)
        model = tf.BartForConditionalGeneration._from_config(cfg, attn_implementation="eager")  # sdpa returns no weights
    else:
        cfg = tf.MarianConfig(**common, decoder_start_token_id=1, activation_function=activation, scale_embedding=scale_embedding)
        model = tf.MarianMTModel._from_config(cfg, attn_implementation="eager")
    torch.manual_seed(0)
    model = model.float().eval()
    with torch.no_grad():  # as for T5: varied outputs, norms and biases that matter
        for name, p in model.named_parameters():
            if family == "marian" and "embed_positions" in name:
                continue  # Marian's sinusoidal table: computed, never saved
            if "layer_norm" in name or "layernorm" in name:
                p.copy_((1 if name.endswith("weight") else 0) + torch.randn_like(p) * 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "shared" in name or "embed_tokens" in name:
                p.normal_(0, 1.0)
                p.mul_(spread / p.norm(dim=1, keepdim=True))
            elif name.endswith(("out_proj.weight", "fc2.weight")):
                p.normal_(0, gain / p.shape[1] ** 0.5)
            elif p.ndim == 2:
                p.normal_(0, 1 / p.shape[1] ** 0.5)
        model.final_logits_bias.normal_(0, 0.5)
    d = tmp_path / family
    model.save_pretrained(d, safe_serialization=True)
    return model, d


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_bart_and_marian_equal_transformers(family, torch, tmp_path):
    model, d = _tiny_bart(family, torch, tmp_path)
    lm = load_seq2seq_lm(d)
    assert lm.config.pre_norm is False and lm.config.position == ("learned" if family == "bart" else "sinusoidal")
    rng = np.random.default_rng(0)
    src = rng.integers(3, V, size=(2, 13))
    dec = np.concatenate([np.full((2, 1), lm.config.decoder_start_token_id), rng.integers(3, V, size=(2, 9))], axis=1)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(src), decoder_input_ids=torch.tensor(dec), output_attentions=True)
    out = lm.forward(src, dec, output_attentions=True)
    np.testing.assert_allclose(out.encoder_hidden, ref.encoder_last_hidden_state.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(out.logits, ref.logits.numpy(), atol=1e-4, rtol=0)
    assert (len(ref.encoder_attentions), len(ref.decoder_attentions), len(ref.cross_attentions)) == (2, 2, 2)
    for mine, theirs in zip(out.encoder_attentions + out.decoder_attentions + out.cross_attentions, ref.encoder_attentions + ref.decoder_attentions + ref.cross_attentions):
        np.testing.assert_allclose(mine, theirs.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("family", ["bart", "marian"])
def test_bart_and_marian_generate_equal_transformers(family, num_beams, torch, tmp_path):
    """BART forces EOS as the last token the length allows; Marian starts from the padding token."""
    model, d = _tiny_bart(family, torch, tmp_path)
    lm = load_seq2seq_lm(d)
    rng = np.random.default_rng(1)
    varied = 0
    for _ in range(10):
        src = [0] + rng.integers(3, V, size=int(rng.integers(4, 14))).tolist() + [2]
        with torch.no_grad():
            ref = model.generate(torch.tensor([src]), max_new_tokens=10, num_beams=num_beams, do_sample=False)[0, 1:].tolist()
        got = lm.generate(src, max_new_tokens=10, num_beams=num_beams).token_ids
        assert got == ref[: len(got)] and all(t == 1 for t in ref[len(got) :]), (src, got, ref)  # padded with id 1
        varied += len(set(got)) >= 3
    # A random tiny Marian repeats one token whatever the source (no init tried here changed that): for
    # it this test checks the start token, the forced last token and beam bookkeeping, the forward test
    # the numbers. BART's outputs vary.
    assert varied >= 3 or family == "marian"


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generation_config_ids_bad_words_and_renormalizing_as_transformers_takes_them(num_beams, torch, tmp_path):
    """transformers' generate takes its ids from generation_config.json where it gives them, never writes a
    bad word (Marian's generation config bans its padding token), and with renormalize_logits takes the
    log-softmax again after that, which moves beam scores: a BART whose generation config bans its two
    likeliest tokens, and ends at another id than config.json says (one of them here: EOS is never banned)."""
    import json

    model, d = _tiny_bart("bart", torch, tmp_path)
    rng = np.random.default_rng(1)
    sources = [[0] + rng.integers(3, V, size=int(rng.integers(4, 14))).tolist() + [2] for _ in range(8)]
    plain = load_seq2seq_lm(d)
    counts = np.bincount(np.concatenate([plain.generate(src, max_new_tokens=10, num_beams=num_beams).token_ids for src in sources]), minlength=V)
    banned = [int(t) for t in np.argsort(-counts)[:2] if t != 2]
    fields = {"bad_words_ids": [[t] for t in banned], "renormalize_logits": True, "eos_token_id": 5, "forced_eos_token_id": 5}
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    for key, value in fields.items():
        setattr(model.generation_config, key, value)
    lm = load_seq2seq_lm(d)
    changed = 0
    for src in sources:
        with torch.no_grad():
            ref = model.generate(torch.tensor([src]), max_new_tokens=10, num_beams=num_beams, do_sample=False)[0, 1:].tolist()
        got = lm.generate(src, max_new_tokens=10, num_beams=num_beams).token_ids
        assert got == ref[: len(got)] and all(t == 1 for t in ref[len(got) :]), (src, got, ref)
        assert not set(got) & (set(banned) - {5}) and got[-1] == 5  # (EOS is never a bad word; forced at the last step, or ended there)
        changed += got != plain.generate(src, max_new_tokens=10, num_beams=num_beams).token_ids
    assert changed >= 4
    for bad, match in (({"bad_words_ids": [[7, 8]]}, "bad_words_ids of more than one token are not supported"), ({"bad_words_ids": [7]}, "should be a list of token id lists"),
                       ({"bad_words_ids": [[10**6]]}, r"field 'bad_words_ids' should be a token id or a list of them in \[0, 64\)"),
                       ({"eos_token_id": [2, 5]}, "field 'eos_token_id' lists 2 ids; an encoder-decoder here ends at one"), ({"renormalize_logits": "yes"}, "field 'renormalize_logits' should be true or false")):  # fmt: skip
        (d / "generation_config.json").write_text(json.dumps({**gen, **bad}))
        with pytest.raises(ModelError, match=match):
            load_seq2seq_lm(d)


def _bart_and_a_common_token(torch, tmp_path, *, seed):
    """A tiny BART, 8 random sources, and the token (not a special one) its greedy outputs hold most."""
    model, d = _tiny_bart("bart", torch, tmp_path)
    rng = np.random.default_rng(seed)
    sources = [[0] + rng.integers(3, V, size=int(rng.integers(4, 14))).tolist() + [2] for _ in range(8)]
    plain = load_seq2seq_lm(d)
    counts = np.bincount(np.concatenate([plain.generate(src, max_new_tokens=12).token_ids for src in sources]), minlength=V)
    counts[:3] = 0
    return model, d, sources, int(counts.argmax())


@pytest.mark.parametrize("num_beams", [1, 3])
def test_forced_bos_min_length_and_no_repeat_ngram_as_transformers_applies_them(num_beams, torch, tmp_path):
    """BART-large-CNN's config forces BOS first, bans EOS before a minimum length and bans a repeated
    3-gram; transformers' generate applies all three: the same tokens (had been ignored)."""
    import json

    model, d, sources, eos = _bart_and_a_common_token(torch, tmp_path, seed=2)
    # EOS made a token the model writes often, so that the minimum length has EOS to hold back
    fields = {"forced_bos_token_id": 0, "min_length": 9, "no_repeat_ngram_size": 2, "eos_token_id": eos}
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    for key, value in fields.items():
        setattr(model.generation_config, key, value)
    lm = load_seq2seq_lm(d)
    without = {rule: load_seq2seq_lm(d) for rule in ("forced_bos_token_id", "min_length", "no_repeat_ngram_size")}
    for rule, other in without.items():  # each rule left out in turn: each one changes some outputs
        other.config = dataclasses.replace(other.config, **{rule: None if rule == "forced_bos_token_id" else 0})
    changed = dict.fromkeys(without, 0)
    for src in sources:
        with torch.no_grad():
            ref = model.generate(torch.tensor([src]), max_new_tokens=12, num_beams=num_beams, do_sample=False)[0, 1:].tolist()
        got = lm.generate(src, max_new_tokens=12, num_beams=num_beams).token_ids
        assert got == ref[: len(got)] and all(t == 1 for t in ref[len(got) :]), (src, got, ref)
        pairs = list(zip(got, got[1:]))
        assert got[0] == 0 and len(pairs) == len(set(pairs)) and len(got) >= 8  # BOS first, no pair twice, EOS not before 9 tokens (start included)
        for rule, other in without.items():
            changed[rule] += got != other.generate(src, max_new_tokens=12, num_beams=num_beams).token_ids
    assert min(changed.values()) >= 1, changed


SEARCH_RULES = [
    {"num_beams": 3, "length_penalty": 2.0, "early_stopping": "never", "max_length": 12},
    {"num_beams": 3, "length_penalty": -0.5, "early_stopping": True, "max_new_tokens": 9, "repetition_penalty": 1.6},
    {"max_length": 11, "repetition_penalty": 0.7, "encoder_repetition_penalty": 1.5, "encoder_no_repeat_ngram_size": 2},
    {"num_beams": 2, "encoder_no_repeat_ngram_size": 1, "repetition_penalty": 2.0, "max_new_tokens": 10},
]


def test_search_settings_and_penalties_follow_the_generation_config(torch, tmp_path):
    """A checkpoint's generation config sets the search (opus-mt: 4 or 6 beams and a length; BART-large-CNN:
    4 beams, a length penalty of 2, early stopping) and may set penalties; transformers' generate called
    with no options takes them all, and so does qkv's (they had been the caller's, and the penalties
    ignored). Each field, reset alone to its default, changes some outputs."""
    import json

    model, d, sources, eos = _bart_and_a_common_token(torch, tmp_path, seed=3)  # it ends the text: hypotheses end at many lengths, where the length rules matter
    gen = json.loads((d / "generation_config.json").read_text())
    defaults = {"num_beams": 1, "length_penalty": 1.0, "early_stopping": False, "max_length": None, "max_new_tokens": None, "repetition_penalty": 1.0,
                "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0}  # fmt: skip
    changed = dict.fromkeys(defaults, 0)
    for fields in SEARCH_RULES:
        fields = {**fields, "eos_token_id": eos, "forced_eos_token_id": eos}
        (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
        model.generation_config = type(model.generation_config).from_pretrained(d)
        lm = load_seq2seq_lm(d)
        without = {key: load_seq2seq_lm(d) for key in fields if key in defaults}
        for key, other in without.items():
            other.config = dataclasses.replace(other.config, **{key: defaults[key]})
        for src in sources:
            with torch.no_grad():
                ref = model.generate(torch.tensor([src]))[0, 1:].tolist()  # no options: its generation config's
            got = lm.generate(src).token_ids
            assert got == ref[: len(got)] and all(t == 1 for t in ref[len(got) :]), (fields, src, got, ref)
            for key, other in without.items():
                changed[key] += got != other.generate(src).token_ids
    assert min(changed.values()) >= 1, changed
    # The caller's options still win over the config's
    src = [0, 5, 9, 14, 2]
    with torch.no_grad():
        ref = model.generate(torch.tensor([src]), num_beams=1, max_new_tokens=5, length_penalty=1.0, early_stopping=False)[0, 1:].tolist()
    got = lm.generate(src, 5, num_beams=1, length_penalty=1.0, early_stopping=False).token_ids
    assert got == ref[: len(got)] and len(got) <= 5


def test_generation_config_search_settings_are_checked_at_load(torch, tmp_path):
    import json

    _, d = _tiny_bart("bart", torch, tmp_path)
    gen = json.loads((d / "generation_config.json").read_text())
    for bad, match in (({"num_beams": 0}, "field 'num_beams' should be >= 1"), ({"num_beams": 10**9}, "field 'num_beams' should be at most 256"),
                       ({"num_beams": 2.5}, "field 'num_beams' should be an integer"), ({"length_penalty": "long"}, "field 'length_penalty'"),
                       ({"length_penalty": 1e9}, r"field 'length_penalty' should be a number in \[-10, 10\]"), ({"early_stopping": "sometimes"}, "field 'early_stopping' should be True, False or 'never'"),
                       ({"max_length": 0}, "field 'max_length' should be a positive integer"), ({"max_new_tokens": -3}, "field 'max_new_tokens' should be a positive integer"),
                       ({"repetition_penalty": 0}, r"field 'repetition_penalty' should be a number in \[1e-6, 1e6\]"), ({"encoder_repetition_penalty": True}, "field 'encoder_repetition_penalty'"),
                       ({"encoder_no_repeat_ngram_size": -1}, "field 'encoder_no_repeat_ngram_size' should be a positive integer"),
                       ({"sequence_bias": [[[5], 3.0]]}, "field 'sequence_bias' .* asks transformers' generate for a rule qkv does not apply"),
                       ({"num_beam_groups": 2, "diversity_penalty": 0.5}, "field 'num_beam_groups'"), ({"exponential_decay_length_penalty": [5, 1.5]}, "exponential_decay_length_penalty")):  # fmt: skip
        (d / "generation_config.json").write_text(json.dumps({**gen, **bad}))
        with pytest.raises(ModelError, match=match) as e:
            load_seq2seq_lm(d)
        assert str(e.value).startswith(str(d / "generation_config.json")), e.value
    (d / "generation_config.json").write_text(json.dumps({**gen, "max_length": 1}))
    with pytest.raises(ValueError, match=r"max_length \(1\) leaves no room after the decoder's 1 prompt tokens"):
        load_seq2seq_lm(d).generate([0, 5, 2])


def test_a_source_longer_than_the_model_allows(torch, tmp_path):
    _, d = _tiny_bart("bart", torch, tmp_path)
    lm = load_seq2seq_lm(d)
    with pytest.raises(ValueError, match="the source would reach 41 tokens, past this model's 40 positions"):
        lm.encode(np.full((1, 41), 5))


def test_attention_command_draws_cross_attention(torch, tmp_path):
    """qkv attention SOURCE --target TEXT --model DIR: the cross-attention of the last layer by default."""
    import os
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers

    _, d = _tiny_t5(torch, tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    env = {**os.environ, "MPLBACKEND": "Agg"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "qkv", "attention", *args], capture_output=True, text=True, timeout=300, env=env)

    r = run("w5 w9 w12 w1", "--model", str(d), "--target", "w3 w4 w1", "--out", str(tmp_path / "a"), "--html", str(tmp_path / "a.html"))
    assert r.returncode == 0, r.stderr
    assert "target 3 tokens: ['w3', 'w4', 'w1']" in r.stdout
    assert (tmp_path / "a" / "cross_layer2.png").stat().st_size > 1000 and (tmp_path / "a.html").stat().st_size > 1000
    r = run("w5 w9 w12 w1", "--model", str(d), "--kind", "encoder", "--layer", "0", "--out", str(tmp_path / "b"))  # the encoder needs no target: nothing decoded
    assert r.returncode == 0, r.stderr
    assert "greedy output" not in r.stderr and "target" not in r.stdout and (tmp_path / "b" / "encoder_layer0.png").is_file()
    r = run("w5 w9 w12 w1", "--model", str(d), "--layer", "0", "--out", str(tmp_path / "b"))  # no --target: the model's own output
    assert r.returncode == 0, r.stderr
    assert "no --target: the model's own greedy output" in r.stderr and (tmp_path / "b" / "cross_layer0.png").is_file()
    r = run("w5 w9 w12 w1", "--model", str(d), "--head", "9")  # checked before decoding
    assert r.returncode == 2 and "--head should be in [0, 3], got 9" in r.stderr and "greedy output" not in r.stderr
    r = run("hello", "--target", "x", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "--target and --kind need an encoder-decoder --model" in r.stderr


def test_generate_command_runs_an_encoder_decoder_as_transformers_does(torch, tmp_path):
    """qkv generate SOURCE --model DIR [--num-beams N ...]: the target transformers' generate gives."""
    import json as js
    import os
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers

    model, d = _tiny_t5(torch, tmp_path, decoder_layers=2, eos_gain=1.5)  # transformers' generate sizes its cache by num_layers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "qkv", "generate", *args], capture_output=True, text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})

    source = "w5 w9 w12 w7 w30"
    src = tok.encode(source).ids
    lengths = set()
    for options in ([], ["--num-beams", "3"], ["--num-beams", "4", "--length-penalty", "-0.5", "--early-stopping"], ["--num-beams", "3", "--length-penalty", "2", "--early-stopping", "never"]):
        r = run(source, "--model", str(d), "--max-new-tokens", "10", "--json", *options)
        assert r.returncode == 0, r.stderr
        got = js.loads(r.stdout)
        beams = int(options[1]) if options else 1
        extra = dict(length_penalty=float(options[3]), early_stopping=True if options[-1] == "--early-stopping" else options[-1]) if "--early-stopping" in options else {}
        with torch.no_grad():
            want = model.generate(torch.tensor([src]), max_new_tokens=10, num_beams=beams, do_sample=False, **extra)[0, 1:].tolist()
        n = len(got["token_ids"])
        assert got["token_ids"] == want[:n] and all(t == 0 for t in want[n:]), (options, got, want)  # transformers pads finished beams
        assert got["source_ids"] == src and got["num_beams"] == beams and got["text"] == tok.decode(got["token_ids"])
        lengths.add(n)
    assert len(lengths) >= 2  # the options changed the answer: the comparison means something
    r = run(source, "--model", str(d), "--num-beams", "2")
    assert r.returncode == 0 and r.stdout.strip() and "2 beams, score" in r.stderr
    # No options: the model's generation config's search and length, as transformers' generate takes them
    gen = js.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(js.dumps({**gen, "num_beams": 3, "length_penalty": 2.0, "max_length": 8}))
    model.generation_config = type(model.generation_config).from_pretrained(d)
    r = run(source, "--model", str(d), "--json")
    assert r.returncode == 0, r.stderr
    got = js.loads(r.stdout)
    with torch.no_grad():
        want = model.generate(torch.tensor([src]))[0, 1:].tolist()
    assert got["token_ids"] == want[: len(got["token_ids"])] and got["num_beams"] == 3 and len(got["token_ids"]) <= 7, (got, want)
    r = run(source, "--model", str(d), "--early-stopping", "sometimes")
    assert r.returncode == 2 and "--early-stopping: should be true, false or never, got 'sometimes'" in r.stderr
    r = run(source, "--model", str(d), "--temperature", "0.7")
    assert r.returncode == 2 and "--temperature: not for an encoder-decoder --model" in r.stderr
    r = run(source, "--model", str(d), "--num-beams", "1000")
    assert r.returncode == 2 and "num_beams should be at most 256" in r.stderr
    r = run("hi", "--num-beams", "3")  # the default causal LM: no beam search
    assert r.returncode == 2 and "--num-beams: beam search is for an encoder-decoder --model" in r.stderr


# ------------------------------------------------------------------ Whisper


def _audio():
    t = np.arange(16_000 * 3) / 16_000
    sweep = np.sin(2 * np.pi * (100 + 2_600 * t) * t) * 0.5  # 100 Hz rising through 8 kHz
    noise = np.random.default_rng(0).standard_normal(16_000 * 2) * 0.1
    return {"sweep": sweep, "silence": np.zeros(16_000), "noise": noise, "full 30 s": np.tile(noise, 15)}


@pytest.mark.parametrize("kind", list(_audio()))
def test_log_mel_equals_whisper_feature_extractor(kind):
    """Against transformers' WhisperFeatureExtractor on its NumPy path (its torch path rounds the STFT in
    float32: up to 6e-5 away from both)."""
    from transformers import WhisperFeatureExtractor

    from qkv.models.families.whisper import log_mel_spectrogram

    audio = _audio()[kind]
    for n_mels in (80, 128):
        fe = WhisperFeatureExtractor(feature_size=n_mels)
        padded = np.zeros(480_000)
        padded[: audio.size] = audio
        want = fe._np_extract_fbank_features(padded[None], "cpu")[0]
        got = log_mel_spectrogram(audio, sampling_rate=16_000, n_mels=n_mels)
        assert got.shape == want.shape == (n_mels, 3000) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_log_mel_of_long_audio_is_the_feature_extractors_unpadded():
    """Past 30 s the spectrogram is the whole recording's, as WhisperFeatureExtractor gives it with
    truncation=False and padding="longest" (long-form transcription), loudness clipped against its loudest frame."""
    from transformers import WhisperFeatureExtractor

    from qkv.models.families.whisper import log_mel_spectrogram

    rng = np.random.default_rng(0)
    t = np.arange(16_000 * 47 + 123) / 16_000
    audio = np.sin(2 * np.pi * (200 + 40 * t) * t) * np.where(t < 20, 0.05, 0.8) + rng.normal(0, 0.01, t.size)  # loud only after 20 s
    fe = WhisperFeatureExtractor()
    want = fe(audio, sampling_rate=16_000, truncation=False, padding="longest", return_tensors="np", device="cpu").input_features[0]
    got = log_mel_spectrogram(audio, sampling_rate=16_000)
    assert got.shape == want.shape == (80, audio.size // 160) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=6e-5, rtol=0)
    np.testing.assert_allclose(got, fe._np_extract_fbank_features(audio[None], "cpu")[0], atol=1e-5, rtol=0)


def test_log_mel_refuses_what_whisper_cannot_hear():
    from qkv.models.families.whisper import log_mel_spectrogram

    with pytest.raises(ValueError, match="sampling_rate should be 16000 .*resample it first.*got 44100"):
        log_mel_spectrogram(np.zeros(44_100), sampling_rate=44_100)
    with pytest.raises(ValueError, match="audio is 7,200.0 s, longer than the 7,200 s qkv transcribes at once"):  # a view: refused before any allocation
        log_mel_spectrogram(np.broadcast_to(np.float32(0), (16_000 * 2 * 3600 + 1,)), sampling_rate=16_000)
    with pytest.raises(ValueError, match="audio should be 1-D samples"):
        log_mel_spectrogram(np.zeros((2, 16_000)), sampling_rate=16_000)
    with pytest.raises(ValueError, match="audio should be finite"):
        log_mel_spectrogram(np.array([0.0, np.nan]), sampling_rate=16_000)


def _tiny_whisper(torch, tmp_path, gain=6.0, spread=1.0, vocab_size=V, positions=40):
    import transformers as tf

    cfg = tf.WhisperConfig(vocab_size=vocab_size, num_mel_bins=80, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=48, decoder_ffn_dim=48, max_source_positions=1500, max_target_positions=positions, decoder_start_token_id=3,
                           eos_token_id=2, pad_token_id=0, bos_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)  # fmt: skip
    torch.manual_seed(0)
    model = tf.WhisperForConditionalGeneration._from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # as for T5: varied outputs, norms and biases that matter
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.copy_((1 if name.endswith("weight") else 0) + torch.randn_like(p) * 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "embed_tokens" in name:
                p.normal_(0, 1.0)
                p.mul_(spread / p.norm(dim=1, keepdim=True))
            elif "encoder_attn.out_proj" in name:  # averaged over 1,500 frames it is nearly constant: kept small
                p.normal_(0, 0.3 / p.shape[1] ** 0.5)
            elif name.endswith(("out_proj.weight", "fc2.weight")):
                p.normal_(0, gain / p.shape[1] ** 0.5)
            elif p.ndim >= 2 and "embed_positions" not in name:
                p.normal_(0, 1 / np.sqrt(np.prod(p.shape[1:])))
    d = tmp_path / "whisper"
    model.save_pretrained(d, safe_serialization=True)
    return model, d


def test_whisper_equals_transformers(torch, tmp_path):
    from qkv.models.families.whisper import WhisperLM

    model, d = _tiny_whisper(torch, tmp_path)
    lm = load_seq2seq_lm(d)
    assert isinstance(lm, WhisperLM)
    feats = np.stack([lm.features(a, sampling_rate=16_000)[0] for a in (_audio()["sweep"], _audio()["noise"])])  # (2, 80, 3000)
    dec = np.concatenate([np.full((2, 1), 3), np.random.default_rng(0).integers(4, V, size=(2, 8))], axis=1)
    with torch.no_grad():
        ref = model(input_features=torch.tensor(feats), decoder_input_ids=torch.tensor(dec), output_attentions=True)
    out = lm.forward(feats, dec, output_attentions=True)
    np.testing.assert_allclose(out.encoder_hidden, ref.encoder_last_hidden_state.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(out.logits, ref.logits.numpy(), atol=1e-4, rtol=0)
    assert len(ref.encoder_attentions) == len(ref.decoder_attentions) == len(ref.cross_attentions) == 2
    for mine, theirs in zip(out.encoder_attentions + out.decoder_attentions + out.cross_attentions, ref.encoder_attentions + ref.decoder_attentions + ref.cross_attentions):
        np.testing.assert_allclose(mine, theirs.numpy(), atol=1e-5, rtol=0)
    assert out.cross_attentions[0].shape == (2, 4, 9, 1500)  # every target token over 1,500 audio positions


@pytest.mark.parametrize("num_beams", [1, 3])
def test_whisper_generate_suppresses_what_generation_config_says_as_transformers_does(num_beams, torch, tmp_path):
    """generation_config.json's suppress_tokens (never generated) and begin_suppress_tokens (never first):
    real Whisper checkpoints list both, and transformers' generate applies them; qkv had not."""
    import json

    model, d = _tiny_whisper(torch, tmp_path)
    audio = _audio()["sweep"]
    free = load_seq2seq_lm(d).generate(audio, max_new_tokens=10, num_beams=num_beams, sampling_rate=16_000).token_ids
    suppress, begin = sorted({t for t in free[1:4] if t not in (2, free[0])}), [free[0]]  # tokens the free run makes
    assert suppress
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "suppress_tokens": suppress, "begin_suppress_tokens": begin}))
    model.generation_config.suppress_tokens, model.generation_config.begin_suppress_tokens = suppress, begin
    lm = load_seq2seq_lm(d)
    assert lm.config.suppress_tokens == tuple(suppress) and lm.config.begin_suppress_tokens == tuple(begin)
    with torch.no_grad():
        ref = model.generate(torch.tensor(lm.features(audio, sampling_rate=16_000)), max_new_tokens=10, num_beams=num_beams).tolist()[0]
    got = lm.generate(audio, max_new_tokens=10, num_beams=num_beams, sampling_rate=16_000).token_ids
    assert got == ref[: len(got)] and all(t == 0 for t in ref[len(got) :]), (got, ref)
    assert got[0] != free[0] and not set(got) & set(suppress)


@pytest.mark.parametrize("rules, prompt", [
    ({"forced_decoder_ids": [[1, None], [2, 13], [3, 15]]}, [3, "L", 13, 15]),  # as multilingual checkpoints ship: detect, transcribe, no timestamps
    ({"forced_decoder_ids": [[1, 15]]}, [3, 15]),  # as English-only ones ship
    ({}, [3, "L", 15]),  # nothing forced: the language detected, then <|notimestamps|>
    ({"language": "fr", "task": "translate"}, [3, 11, 14, 15]),
    ({"language": "<|de|>"}, [3, 12, 13, 15]),  # a task is then "transcribe"
    ({"language": "French"}, [3, 11, 13, 15]),  # a name, as the fine-tuning guides set it (had been refused)
])  # fmt: skip
@pytest.mark.parametrize("num_beams", [1, 3])
def test_whisper_prompt_is_forced_as_transformers_forces_it(rules, prompt, num_beams, torch, tmp_path):
    """transformers' Whisper generate starts from the start token, a language (given, or detected: the
    language token with the highest logit after the start token alone), a task and <|notimestamps|>,
    as the generation config says; qkv had started from the start token alone. ("L": the language
    transformers' detect_language finds.)"""
    import json

    model, d = _tiny_whisper(torch, tmp_path)
    fields = {"lang_to_id": {"<|en|>": 10, "<|fr|>": 11, "<|de|>": 12}, "task_to_id": {"transcribe": 13, "translate": 14}, "no_timestamps_token_id": 15, "is_multilingual": True, **rules}
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    for key, value in fields.items():
        setattr(model.generation_config, key, value)
    from transformers.generation import GenerationMixin

    lm = load_seq2seq_lm(d)
    for name in ("sweep", "noise"):
        feats = lm.features(_audio()[name], sampling_rate=16_000)
        with torch.no_grad():
            lang = int(model.detect_language(torch.tensor(feats))[0])
            start = [lang if t == "L" else t for t in prompt]
            # the search after the prompt, by transformers' own generate under Whisper's (which, given these
            # fields, goes on segment after segment: 500 to 4,000 tokens, 10 minutes for this test)
            ref = GenerationMixin.generate(model, input_features=torch.tensor(feats), decoder_input_ids=torch.tensor([start]), max_new_tokens=8, num_beams=num_beams, do_sample=False)
        assert lm.decoder_prompt(lm.encode(feats)) == start
        got = lm.generate(feats, max_new_tokens=8, num_beams=num_beams).token_ids
        want = ref[0, len(start) :].tolist()
        assert got == want[: len(got)] and all(t == 0 for t in want[len(got) :]), (name, got, want)


def test_whisper_language_names_are_transformers_names():
    """A generation config's language may be a name ("hindi"), a code ("hi") or a token ("<|hi|>"), in any
    case: the names and their codes are transformers' own table (TO_LANGUAGE_CODE)."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    from qkv.models.families.whisper import LANGUAGE_CODES

    assert LANGUAGE_CODES == TO_LANGUAGE_CODE


def test_a_whisper_generation_config_is_checked_at_load(torch, tmp_path):
    """Each prompt rule a generation config gives is checked: a malformed one names the file and field
    (a null past the language's position had been dropped from the prompt silently)."""
    _, d = _tiny_whisper(torch, tmp_path)
    gen = json.loads((d / "generation_config.json").read_text())
    langs = {"lang_to_id": {"<|en|>": 10, "<|fr|>": 11}, "task_to_id": {"transcribe": 13, "translate": 14}, "no_timestamps_token_id": 15}
    for fields, match in (
        ({**langs, "forced_decoder_ids": [[1, 11], [2, None]]}, "forced_decoder_ids leaves position 2 open"),
        ({"forced_decoder_ids": [[1, None], [2, 13]]}, "forced_decoder_ids leaves position 1 open .* lang_to_id listing the languages"),
        ({**langs, "forced_decoder_ids": [[2, 11]]}, "forced_decoder_ids should force positions 1, 2, ... in turn"),
        ({**langs, "forced_decoder_ids": [11, 13]}, r"forced_decoder_ids should be \[position, token id\] pairs"),
        ({**langs, "language": "klingon"}, "language 'klingon' is not in lang_to_id"),
        ({**langs, "task": "summarize"}, "task 'summarize' is not in task_to_id"),
        ({**langs, "lang_to_id": {"<|en|>": 10**6}}, r"lang_to_id: field '<\|en\|>' should be a token id in \[0, "),
        ({**langs, "no_timestamps_token_id": -1}, "field 'no_timestamps_token_id' should be a token id"),
    ):
        (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
        with pytest.raises(ModelError, match=match) as e:
            load_seq2seq_lm(d)
        assert str(e.value).startswith(str(d / "generation_config.json")), e.value


@pytest.mark.parametrize("num_beams", [1, 3])
def test_whisper_generate_equals_transformers(num_beams, torch, tmp_path):
    model, d = _tiny_whisper(torch, tmp_path)
    lm = load_seq2seq_lm(d)
    varied = 0
    for name, audio in _audio().items():
        feats = lm.features(audio, sampling_rate=16_000)
        with torch.no_grad():
            ref = model.generate(torch.tensor(feats), max_new_tokens=10, num_beams=num_beams).tolist()[0]  # without the start token
        got = lm.generate(audio, max_new_tokens=10, num_beams=num_beams, sampling_rate=16_000).token_ids
        assert got == ref[: len(got)] and all(t == 0 for t in ref[len(got) :]), (name, got, ref)
        varied += len(set(got)) >= 3
    assert varied >= 2
    with pytest.raises(ValueError, match="sampling_rate should be 16000"):
        lm.generate(np.zeros(8_000), sampling_rate=8_000)


@pytest.mark.parametrize("fields", [{"max_length": 9}, {"max_length": 448}, {"max_new_tokens": 12, "num_beams": 2}], ids=str)
def test_whisper_length_follows_the_generation_config_as_transformers_takes_it(fields, torch, tmp_path):
    """Whisper's generation configs say max_length 448: transformers' Whisper generate counts it in new
    tokens, the prompt's on top, within the decoder's positions (40 here); max_new_tokens likewise. qkv
    had written 32 tokens whatever the config, cutting a 30 s transcript short."""
    import json

    model, d = _tiny_whisper(torch, tmp_path)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    model.generation_config = type(model.generation_config).from_pretrained(d)
    lm = load_seq2seq_lm(d)
    lengths = set()
    for name, audio in _audio().items():
        feats = lm.features(audio, sampling_rate=16_000)
        with torch.no_grad():
            ref = model.generate(torch.tensor(feats)).tolist()[0]  # no options: its generation config's
        got = lm.generate(audio, sampling_rate=16_000).token_ids
        assert got == ref, (name, got, ref)  # (no EOS here: the length rule decides)
        lengths.add(len(got))
    assert lengths == {min(fields.get("max_new_tokens", fields.get("max_length")), 40 - 1)}
    (d / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 40}))  # past the 40 positions with the prompt: refused, as transformers does
    with pytest.raises(ValueError, match=r"max_new_tokens \(40\) and the decoder's 1 prompt tokens pass this model's 40 positions"):
        load_seq2seq_lm(d).generate(_audio()["sweep"], sampling_rate=16_000)


def _long_audio(seconds: int = 47):
    """A rising tone, quiet for 20 s, then loud, in a little noise."""
    rng = np.random.default_rng(0)
    t = np.arange(16_000 * seconds) / 16_000
    return np.sin(2 * np.pi * (200 + 40 * t) * t) * np.where(t < 20, 0.05, 0.8) + rng.normal(0, 0.01, t.size)


def _timestamped_whisper(torch, tmp_path, vocab_size, **fields):
    """A tiny Whisper whose timestamp tokens start at 100 (<|0.00|>): a window moves by at most (vocab_size -
    100) x 0.02 s, so a recording takes several; EOS (40) after the text tokens, as in Whisper's vocabulary."""
    import json

    model, d = _tiny_whisper(torch, tmp_path, vocab_size=vocab_size)
    fields = {"lang_to_id": {"<|en|>": 41, "<|fr|>": 42}, "task_to_id": {"transcribe": 43, "translate": 44}, "no_timestamps_token_id": 99, "is_multilingual": True,
              "eos_token_id": 40, "max_initial_timestamp_index": 5, **fields}  # fmt: skip
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    for key, value in fields.items():
        setattr(model.generation_config, key, value)
    return model, d


@pytest.mark.parametrize("vocab_size, language, num_beams", [(400, None, 1), (400, None, 3), (200, "en", 1)])
def test_whisper_timestamps_and_long_audio_as_transformers_transcribes_them(vocab_size, language, num_beams, torch, tmp_path):
    """With timestamps (asked for, or past 30 s of audio) transformers' Whisper generate decodes 30 s windows
    one after another: each window's text is cut into timed segments at its pairs of timestamps, and the next
    window starts at the last pair (past this window after a single closing timestamp). qkv gives the same
    tokens and the same segments (start, end, tokens) for 30 s and for 47 s of audio, greedy and by beam
    search, the language detected once from the first window or given. (qkv had refused both.)"""
    import json

    model, d = _timestamped_whisper(torch, tmp_path, vocab_size, **({"language": language, "task": "transcribe"} if language else {}))
    lm = load_seq2seq_lm(d)
    for name, audio in (("30 s", _audio()["full 30 s"]), ("47 s", _long_audio())):
        feats = lm.features(audio, sampling_rate=16_000)
        with torch.no_grad():
            ref = model.generate(torch.tensor(feats), max_new_tokens=16, return_timestamps=True, num_beams=num_beams, return_segments=True)
        out = lm.generate(audio, sampling_rate=16_000, max_new_tokens=16, num_beams=num_beams, return_timestamps=True if name == "30 s" else None)  # past 30 s: always
        seq = ref["sequences"][0].tolist()
        assert seq[: len(out.token_ids)] == out.token_ids and all(t == 0 for t in seq[len(out.token_ids) :]), (name, out.token_ids, seq)
        want = [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in ref["segments"][0]]
        assert [(s["start"], s["end"], s["token_ids"]) for s in out.segments] == want, name
        assert out.timings["windows"] >= 2 and out.prompt_ids[1] in (41, 42) and 99 not in out.prompt_ids  # (no <|notimestamps|>)
        assert name == "30 s" or max(s["start"] for s in out.segments) > 30  # the windows went on to the end
    with pytest.raises(ValueError, match=r"the features are 4700 frames, past Whisper's 3000 \(30 s\): transcribing them needs timestamps"):
        lm.generate(_long_audio(), sampling_rate=16_000, return_timestamps=False)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "logprob_threshold": -1.0}))  # a long-form rule transformers would apply: refused, not dropped
    with pytest.raises(ModelError, match="field 'logprob_threshold' .* asks transformers' Whisper generate for a rule qkv does not apply"):
        load_seq2seq_lm(d)


def test_whisper_generate_command_transcribes_a_long_recording_in_timed_segments(torch, tmp_path):
    import json
    import os
    import subprocess
    import sys
    import wave

    from tokenizers import Tokenizer, models, pre_tokenizers

    _, d = _timestamped_whisper(torch, tmp_path, 400)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(400)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    audio = _long_audio()
    with wave.open(str(tmp_path / "long.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16_000)
        f.writeframes(np.round(np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    from qkv.models.families.whisper import read_wav

    want = load_seq2seq_lm(d).generate(read_wav(tmp_path / "long.wav")[0], sampling_rate=16_000, max_new_tokens=16)
    env = {**os.environ, "MPLBACKEND": "Agg"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, timeout=300, env=env)

    r = run("generate", str(tmp_path / "long.wav"), "--model", str(d), "--max-new-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["token_ids"] == want.token_ids and got["segments"] == want.segments and len(want.segments) >= 3
    r = run("generate", str(tmp_path / "long.wav"), "--model", str(d), "--max-new-tokens", "16")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == len(want.segments) and lines[0].startswith(f"[{want.segments[0]['start']:7.2f} -> {want.segments[0]['end']:7.2f}]"), r.stdout
    r = run("attention", str(tmp_path / "long.wav"), "--model", str(d), "--out", str(tmp_path / "a"))
    assert r.returncode != 0 and "long.wav is 47.0 s: qkv attention draws one 30 s window of a recording" in r.stderr, r.stderr
    r = run("generate", "hi", "--timestamps")  # the default causal LM
    assert r.returncode == 2 and "--timestamps: only a Whisper --model writes timestamps" in r.stderr


def test_whisper_reads_a_wav_and_the_attention_command_draws_it(torch, tmp_path):
    import os
    import subprocess
    import sys
    import wave

    from tokenizers import Tokenizer, models, pre_tokenizers

    from qkv.models.families.whisper import read_wav

    _, d = _tiny_whisper(torch, tmp_path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    sweep = _audio()["sweep"]
    for rate, name in ((16_000, "ok.wav"), (44_100, "cd.wav")):
        with wave.open(str(tmp_path / name), "wb") as f:
            f.setnchannels(2)
            f.setsampwidth(2)
            f.setframerate(rate)
            pcm = np.round(np.repeat(sweep[:, None], 2, axis=1) * 32767).astype("<i2")  # the same sound in both channels
            f.writeframes(pcm.tobytes())
    audio, rate = read_wav(tmp_path / "ok.wav")
    assert rate == 16_000 and audio.shape == sweep.shape and np.abs(audio - sweep).max() < 1e-4  # 16-bit rounding
    env = {**os.environ, "MPLBACKEND": "Agg"}
    r = subprocess.run([sys.executable, "-m", "qkv", "attention", str(tmp_path / "ok.wav"), "--model", str(d), "--target", "w5 w6", "--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "source 1500 positions (20 ms each)" in r.stdout and (tmp_path / "a" / "cross_layer1.png").stat().st_size > 1000
    assert "target 2 tokens: ['w5', 'w6']" in r.stdout  # nothing forced
    # A given target comes after the prompt the generation config forces, as the model reads a transcript
    # (the prompt itself is checked against transformers in test_whisper_prompt_is_forced_as_transformers_forces_it)
    gen = json.loads((d / "generation_config.json").read_text())
    fields = {"lang_to_id": {"<|en|>": 10, "<|fr|>": 11}, "task_to_id": {"transcribe": 13, "translate": 14}, "no_timestamps_token_id": 15, "is_multilingual": True, "language": "fr", "task": "translate"}
    (d / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    r = subprocess.run([sys.executable, "-m", "qkv", "attention", str(tmp_path / "ok.wav"), "--model", str(d), "--target", "w5 w6", "--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "target 5 tokens: ['w11', 'w14', 'w15', 'w5', 'w6']" in r.stdout
    (d / "generation_config.json").write_text(json.dumps(gen))
    r = subprocess.run([sys.executable, "-m", "qkv", "attention", str(tmp_path / "cd.wav"), "--model", str(d), "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0 and "sampling_rate should be 16000" in r.stderr and "resample" in r.stderr


def test_separate_target_embeddings_are_refused(torch, tmp_path):
    """A checkpoint whose decoder has embeddings of its own (Marian with share_encoder_decoder_embeddings
    false) is refused by name rather than run with the shared table."""
    from safetensors.numpy import load_file, save_file

    _, d = _tiny_bart("bart", torch, tmp_path)
    w = load_file(str(d / "model.safetensors"))
    w["model.decoder.embed_tokens.weight"] = w["model.shared.weight"] + 1
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ModelError, match="'model.decoder.embed_tokens.weight' differs from the shared embeddings"):
        load_seq2seq_lm(d)
