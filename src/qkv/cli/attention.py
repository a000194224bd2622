"""``qkv attention``: heatmaps and the explorer of a real model's attention (encoder, decoder or encoder-decoder)."""

from __future__ import annotations

import sys

import numpy as np

from ..models.formats.tokenizer import tokenizer_call
from .common import CLIError, DECODER_NAME, _check_layer_head, _html_path, _is_causal_lm, _is_seq2seq, _load, _load_seq2seq, _model_type, _out_dir, _plots_module, _seq2seq_source, _text


#: The attention weights ``qkv attention`` may hold (every layer's, float32): the model returns them all at once,
#: L**2 values a head and layer. 3,001 tokens of Gemma 3 270M had held 6.8 GB before this bound.
MAX_WEIGHT_BYTES = 2 << 30


def _check_weights(values: int, what: str) -> None:
    """Refuse, before running the model, a text whose attention weights would take more than
    :data:`MAX_WEIGHT_BYTES`; ``values`` is how many weights the model would return."""
    if values * 4 > MAX_WEIGHT_BYTES:
        raise CLIError(f"{what}: the model's attention weights would take {values * 4 / 2**30:.1f} GiB, past the {MAX_WEIGHT_BYTES >> 30} GiB "
                       "qkv attention holds; give a shorter text (a picture of that many tokens labels only a few anyway)")


def _stack_layers(attentions) -> np.ndarray:  # a list of (1, H, L, S) -> (layers, H, L, S)
    """The first row of each layer's weights in one array, each layer let go once copied (np.stack
    holds the list and the stack at once: twice the weights at the peak)."""
    attentions = list(attentions)
    out = np.empty((len(attentions), *attentions[0].shape[1:]), attentions[0].dtype)
    for i in range(len(attentions)):
        out[i], attentions[i] = attentions[i][0], None
    return out


def _attention_seq2seq(args, plots, out_dir) -> int:
    """An encoder-decoder's attention: the cross-attention (target tokens over source tokens) by default,
    or its encoder's or decoder's self-attention (--kind)."""
    lm = _load_seq2seq(args.model, "attention")
    kind = args.kind or "cross"
    n_layers = lm.config.encoder_layers if kind == "encoder" else lm.config.decoder_layers
    _check_layer_head(args, n_layers, lm.config.num_heads)  # before any work: decoding takes a while
    src = _seq2seq_source(lm, args.text, "TEXT")
    if lm.config.family == "whisper" and src.shape[-1] > 3000:  # the encoder hears 30 s: one window's attention is drawn
        raise CLIError(f"{args.text} is {src.shape[-1] / 100:.1f} s: qkv attention draws one 30 s window of a recording; cut it (qkv generate transcribes it whole)")
    source_tokens = [f"{t * 0.02:.2f}s" for t in range(1500)] if lm.config.family == "whisper" else None  # an encoder position is 20 ms of audio
    if args.target is None and kind == "encoder":  # the encoder's attention needs no target
        tgt = []
    elif args.target is None:
        # greedy, whatever search the generation config sets, and Whisper without timestamps: one window's text, a quick picture
        out = lm.generate(src, max_new_tokens=40, num_beams=1, **({"return_timestamps": False} if lm.config.family == "whisper" else {}))
        tgt = out.prompt_ids[1:] + out.token_ids  # (Whisper: the language, task and no-timestamps tokens first, as the model saw them)
        print(f"no --target: the model's own greedy output, {len(tgt)} tokens: {out.text!r}", file=sys.stderr)
    else:
        tgt = tokenizer_call(lm.tokenizer.backend.encode, _text(args.target), add_special_tokens=False).ids
        if lm.config.family == "whisper":  # the text after the prompt its generation config forces (language, task, no timestamps), as the model reads a transcript
            tgt = lm.decoder_prompt(lm.encode(src))[1:] + tgt
    if not tgt and kind != "encoder":
        raise CLIError("the target is empty: give --target TEXT")
    dec_in = [lm.config.decoder_start_token_id] + tgt[:-1]  # teacher forcing: row i predicts target token i
    c, S, T = lm.config, 1500 if source_tokens is not None else len(src), len(dec_in)  # (Whisper's encoder: 1,500 positions)
    _check_weights(c.num_heads * (c.encoder_layers * S * S + c.decoder_layers * (T * T + T * S)), f"{S:,} source and {T:,} target tokens")
    res = lm.forward(src if source_tokens is not None else [src], [dec_in], output_attentions=True)
    att = _stack_layers({"cross": res.cross_attentions, "encoder": res.encoder_attentions, "decoder": res.decoder_attentions}[kind])  # (layers, H, L, S)
    n_layers, n_heads = att.shape[:2]
    token = lm.tokenizer.token
    source = source_tokens or [token(i) for i in src]
    target, decoder = [token(i) for i in tgt], [token(i) for i in dec_in]
    keys, queries = {"cross": (source, decoder), "encoder": (source, source), "decoder": (decoder, decoder)}[kind]
    layer = n_layers - 1 if args.layer is None else args.layer
    heads = list(range(n_heads)) if args.head is None else [args.head]
    what = {"cross": "cross-attention (decoder rows over source columns)", "encoder": "encoder self-attention", "decoder": "decoder self-attention (causal)"}[kind]
    written = []
    scale = args.scale if args.scale != "auto" else ("log" if len(keys) > 50 else "linear")  # long sources: most weights are small
    if plots is not None:
        title = f"{lm.name}: {what}, layer {layer}"
        fig = plots.plot_attention(att[layer, heads], keys, query_tokens=queries, head_names=[f"head {h}" for h in heads], title=title, annotate=False, scale=scale)
        written.append(plots.save(fig, out_dir / (f"{kind}_layer{layer}" + ("" if args.head is None else f"_head{args.head}") + ".png")))
    if args.html is not None:  # the three kinds side by side, each an explorer of every layer and head
        from .. import explorer, masks

        def view(ws, queries, keys, name, mask=None):
            w = np.stack([a[0] for a in ws])  # (layers, H, L, S)
            return dict(weights=w, tokens=queries, key_tokens=keys, mask=mask, layer_names=[f"{name} {i}" for i in range(len(ws))], layer=args.layer, head=args.head, scale=scale)

        views = {
            "encoder self-attention (source over source)": view(res.encoder_attentions, source, source, "encoder"),
            "decoder self-attention (causal)": view(res.decoder_attentions, decoder, decoder, "decoder", masks.causal(len(decoder))),
            "cross-attention (decoder rows over source columns)": view(res.cross_attentions, decoder, source, "cross"),
        }
        written.append(explorer.write_views_html(args.html, views, title=f"{lm.name}: encoder, decoder and cross-attention"))
    print(f"source {len(source)} " + ("positions (20 ms each)" if source_tokens else f"tokens: {source}"))
    if target:
        print(f"target {len(target)} tokens: {target}")
    for path in written:
        print(f"wrote {path}")
    return 0


def _attention_lm(args, plots, out_dir) -> int:
    lm = _load(args.model, "decoder")
    cfg = lm.config
    _check_layer_head(args, cfg.num_layers, cfg.num_heads)
    ids = lm.tokenizer.encode(args.text)
    tokens = [lm.tokenizer.token(i).replace("\u2581", " ") for i in ids]
    _check_weights(cfg.num_layers * cfg.num_heads * len(ids) ** 2, f"{len(ids):,} tokens")
    if len(ids) > 50:
        print(f"qkv: {len(ids)} tokens: running {lm.name} and drawing...", file=sys.stderr, flush=True)
    att = _stack_layers(lm.forward(ids, output_attentions=True, logits_to_keep=1).attentions)  # (layers, H, L, L)
    from .. import masks

    L = len(ids)
    keep = np.stack([masks.causal(L) if w is None else masks.sliding_window(L, L, left=w - 1, right=0) for w in cfg.windows])  # (layers, L, L)
    notes = [f" ({'window ' + str(w) if w else 'full'})" for w in cfg.windows]
    return _draw_attention(args, plots, out_dir, att, tokens, lm.name, notes, keep=keep)


def cmd_attention(args) -> int:
    args.text = _text(args.text)
    args.html = None if args.html is None else _html_path(args.html)
    plots = out_dir = None
    if args.html is None or args.out is not None:  # --html alone writes no PNG (and needs no matplotlib)
        plots = _plots_module()
        out_dir = _out_dir("qkv-attention" if args.out is None else args.out)
    if _is_seq2seq(args.model):
        return _attention_seq2seq(args, plots, out_dir)
    if args.target is not None or args.kind is not None:
        from ..models.load import SEQ2SEQ_FAMILIES

        found = _model_type(args.model)
        runs = ", ".join(SEQ2SEQ_FAMILIES)
        if found is not None:
            raise CLIError(f"--target and --kind need an encoder-decoder --model; {args.model} holds model_type {found!r}, which qkv does not run as one (it runs: {runs})")
        raise CLIError(f"--target and --kind need an encoder-decoder --model: a Hugging Face directory of one of {runs}")
    if args.model == DECODER_NAME or _is_causal_lm(args.model):
        return _attention_lm(args, plots, out_dir)
    enc = _load(args.model)
    cfg = enc.model.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    _check_layer_head(args, n_layers, n_heads)
    res = enc.encode_batch([args.text], output_attentions=True)
    tokens = res.tokens[0]
    n = len(tokens)
    att = np.stack([a[0, :, :n, :n] for a in res.attentions])  # (layers, H, L, L): an encoder's L is at most its max_seq_length
    return _draw_attention(args, plots, out_dir, att, tokens, enc.name, [""] * n_layers)


def _draw_attention(args, plots, out_dir, att, tokens, name, layer_notes, keep=None) -> int:
    """Draw one layer's heads, one head's layers, or one panel; ``keep`` (layers, L, S) marks what each layer may see."""
    n_layers, n_heads = att.shape[:2]
    if args.head is not None and args.layer is None:
        weights, names = att[:, args.head], [f"layer {i}{layer_notes[i]}" for i in range(n_layers)]
        mask = keep
        title, fname = f"{name}: head {args.head} in every layer", f"attention_head{args.head}.png"
    else:
        layer = n_layers - 1 if args.layer is None else args.layer
        heads = range(n_heads) if args.head is None else [args.head]
        weights, names = att[layer, list(heads)], [f"head {h}" for h in heads]
        mask = None if keep is None else keep[layer]
        title = f"{name}: layer {layer}{layer_notes[layer]}, " + ("every head" if args.head is None else f"head {args.head}")
        fname = f"attention_layer{layer}" + ("" if args.head is None else f"_head{args.head}") + ".png"
    scale = args.scale if args.scale != "auto" else ("log" if len(tokens) > 50 else "linear")
    written = []
    thinned = plots is not None and len(tokens) > plots.MAX_TICKS  # a PNG labels only every k-th token past this
    if thinned and args.html is None:
        title += f"\n{len(tokens)} tokens: every {plots.labelled_every(len(tokens))}th labelled; the explorer (--html FILE) shows each token and weight"
    if plots is not None:
        written.append(plots.save(plots.plot_attention(weights, tokens, mask=mask, head_names=names, title=title, annotate=False, scale=scale), out_dir / fname))
    if args.html is not None:
        from .. import explorer

        every = None if keep is None else keep[:, None]  # (layers, 1, L, S): the same mask for every head
        layers = [f"layer {i}{layer_notes[i]}" for i in range(n_layers)]
        written.append(explorer.write_html(args.html, att, tokens, mask=every, layer_names=layers, title=f"{name}: attention", layer=args.layer, head=args.head, scale=scale))
    shown = tokens if len(tokens) <= 40 else tokens[:20] + [f"... {len(tokens) - 30} more ..."] + tokens[-10:]
    print(f"{len(tokens)} tokens: {shown}")
    for path in written:
        print(f"wrote {path}")
    if thinned and args.html is None:
        print(f"qkv: {len(tokens)} tokens are too many to label in a PNG (every {plots.labelled_every(len(tokens))}th is); for each token and weight open the explorer: add --html FILE.html", file=sys.stderr)
    return 0
