"""Write small Hugging Face models to GGUF as llama.cpp's converter lays them out, with the gguf package's
writer, for tests: llama.cpp's tensor names (gguf's own name map), its reordering of Llama's query and key
rows, GPT-2's Conv1D weights transposed, and a byte-level BPE or a SentencePiece vocabulary.

qkv never writes GGUF. That a file written here is what llama.cpp writes is checked where it is used:
transformers' GGUF loader (a second, independent reader) reads it back into the model it came from.
"""

from __future__ import annotations

import math

import numpy as np

CONTROL, NORMAL, USER_DEFINED, BYTE, UNKNOWN = 3, 1, 4, 6, 2
CORPUS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b  # 12 + 345 = 357\n",
    "Die Straße in München; café naïve, 日本語 and 😀 too.",
    "the the the cat sat on the mat; the dog sat on the log.",
] * 4
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab(vocab_size: int = 300):
    """(tokens, merges, types) of a byte-level BPE trained on a small corpus, its specials last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(BPE_SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    import json

    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + BPE_SPECIALS
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [NORMAL] * (len(tokens) - len(BPE_SPECIALS)) + [CONTROL] * len(BPE_SPECIALS)
    return tokens, merges, types


def sentencepiece_vocab(vocab_size: int = 400):
    """(tokens, scores, types) of a SentencePiece-style BPE vocabulary: <unk>, <s>, </s>, the 256 byte
    tokens, then pieces ranked by their score (a merge learned earlier scores higher)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 259, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    return tokens, scores, types


def _unpermuted_to_gguf(w, heads):  # (heads * D, E): Hugging Face's rotate-half rows -> llama.cpp's pairs
    D = w.shape[0] // heads
    return w.reshape(heads, 2, D // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant_rows(qtype, rows: int, cols: int, rng):
    """Random valid blocks of a K-quant (scales small and positive, as real files have them)."""
    import gguf

    T = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[T]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype not in ("Q4_K", "Q5_K", "Q6_K"):  # bytes only: for files qkv should refuse
        return raw.reshape(rows, -1)
    d = (rng.uniform(0.002, 0.01, size=(rows, cols // block))).astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    if qtype == "Q6_K":  # ..., d at the end
        raw[..., size - 2 :] = d
    else:  # d, dmin first
        raw[..., 0:2] = d
        raw[..., 2:4] = (rng.uniform(0.0, 0.01, size=(rows, cols // block))).astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _llama3_rope_factors(dim: int, rope: dict) -> np.ndarray:
    """Llama 3.1's RoPE scaling as llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) stores it: for each
    frequency the number llama.cpp divides it by: 1 for short wavelengths, the factor for long ones, and a
    smooth mix between. Written here in the converter's own terms (a loop of Python floats), not qkv's."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def write(model, path, *, arch: str, outtype: str = "F32", vocab=None, spm: bool = False, chat_template=None, rng=None, add_bos="as converters write it", metadata=()):
    """Write ``model`` (a transformers model of family ``arch``) to ``path`` in llama.cpp's layout.

    ``outtype``: F32, F16 or Q8_0 (2-D weights quantized by ``gguf.quants``, as the converter does, norms
    and biases F32), or a K-quant (Q4_K, Q5_K, Q6_K): 2-D weights replaced by random valid blocks, which
    the model is then defined by (both readers read the same bytes). Returns the weights as written.
    ``metadata``: more keys, as ``(writer method, key, value)``: ``("add_float32", "general.sampling.temp", 0.7)``.
    """
    import gguf

    cfg = model.config
    extra = {}  # tensors of llama.cpp's own, not in the model's state dict
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    n = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[{"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gpt2": "GPT2"}[arch]], n)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(n)
    if arch == "gpt2":
        E = cfg.n_embd
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(E)
        w.add_feed_forward_length(cfg.n_inner or 4 * E)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        E, H, Hk = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or E // H
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(E)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(H)
        w.add_head_count_kv(Hk)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta))
        w.add_rope_dimension_count(D)
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope.get("rope_type") in ("linear", "yarn"):  # as llama.cpp's converter writes these scalings
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if rope["rope_type"] == "linear" else gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(rope["factor"]))
        elif rope.get("rope_type") == "llama3":  # its converter's rope_freqs.weight: a divisor for each frequency
            extra["rope_freqs.weight"] = _llama3_rope_factors(D, rope)
        if arch == "qwen3":
            w.add_key_length(D)
            w.add_value_length(D)
    if spm:
        tokens, scores, types = vocab or sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        if add_bos is not None:  # None: no tokenizer.ggml.add_bos_token key at all
            w.add_add_bos_token(True if add_bos == "as converters write it" else add_bos)
    else:
        tokens, merges, types = vocab or byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre({"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "gpt2": "gpt-2"}[arch])
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|endoftext|>"))
        if add_bos is not None:
            w.add_add_bos_token(False if add_bos == "as converters write it" else add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    written = {}
    for name, t in sd.items():
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        if arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            t = np.ascontiguousarray(t.T)  # Conv1D (in, out) -> (out, in), as llama.cpp's converter writes it
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = _unpermuted_to_gguf(t, H)
        if arch == "llama" and name.endswith("k_proj.weight"):
            t = _unpermuted_to_gguf(t, Hk)
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise KeyError(f"no GGUF name for {name}")
        if t.ndim == 2 and outtype == "F16":
            w.add_tensor(gname, t.astype(np.float16))
            written[gname] = t.astype(np.float16).astype(np.float32)
        elif t.ndim == 2 and outtype != "F32" and not gname.startswith("position_embd"):
            T = gguf.GGMLQuantizationType[outtype]
            if outtype in ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"):
                raw = random_kquant_rows(outtype, t.shape[0], t.shape[1], rng)
            else:
                raw = gguf.quants.quantize(t, T)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=T)
            written[gname] = None if outtype in ("Q2_K", "Q3_K") else gguf.quants.dequantize(raw, T).reshape(t.shape)
        else:
            w.add_tensor(gname, np.ascontiguousarray(t))
            written[gname] = t
    for gname, t in extra.items():
        w.add_tensor(gname, t)
        written[gname] = t
    for method, key, value in metadata:
        getattr(w, method)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
