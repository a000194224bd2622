"""``qkv train``: a small transformer trained from scratch in NumPy until an induction head (or an alignment) forms."""

from __future__ import annotations

import json
import sys

import numpy as np

from .common import CLIError, _out_dir, _plots_module


def cmd_train(args) -> int:
    from .. import train as tr

    if args.task not in tr.TASKS:
        raise CLIError(f"TASK should be one of {', '.join(sorted(tr.TASKS))}, got {args.task!r}")
    if args.steps is not None and args.steps < 1:
        raise CLIError(f"--steps should be >= 1, got {args.steps}")
    if args.seed < 0:
        raise CLIError(f"--seed should be >= 0, got {args.seed}")
    # The weights are written as safetensors when the models extra is there; the pictures need only viz.
    try:
        import safetensors.numpy  # noqa: F401

        save = True
    except ImportError:
        save = False
    plots = _plots_module()
    out_dir = _out_dir(args.out)
    task = tr.TASKS[args.task]
    progress = sys.stderr if args.json else sys.stdout
    print(f"training a transformer on the {args.task} task ({task.description}); seed {args.seed}", file=progress, flush=True)
    if not save:
        print("qkv: the weights will not be saved (model.safetensors needs the models extra: pip install 'qkv[models]'); the pictures will", file=sys.stderr, flush=True)

    def show(step, loss, acc, rate):
        print(f"step {step:5d}  loss {loss:.4f}  accuracy {acc:.3f}  {rate:,.0f} tokens/s", file=progress, flush=True)

    model, res = tr.train(args.task, steps=args.steps, seed=args.seed, on_step=show)
    scores = tr.head_scores(model, args.task)
    strongest = tr.strongest_heads(scores)
    files = [model.save(out_dir / "model.safetensors")] if save else []
    files.append(plots.save(plots.plot_training(res.history, title=f"{args.task}: training loss and accuracy (held-out accuracy {res.accuracy:.3f})"), out_dir / "loss.png"))
    x, _, _ = tr.make_batch(args.task, 1, np.random.default_rng([args.seed, 4]))
    from .. import explorer, masks

    if args.task in tr.SEQ2SEQ:  # the cross-attention of each decoder layer: target words (rows) over source words
        src = x[0]
        _, _, seen = model.forward(x, want_weights=True)
        source = [f"s{t}" for t in src[0]]
        target = [f"t{t}" for t in tr.dictionary(task.vocab)[src[0, ::-1]]]  # what each row predicts
        for i, w in enumerate(seen["cross"]):
            fig = plots.plot_attention(w[0], source, query_tokens=target, title=tr.layer_title(args.task, i, len(seen["cross"]), strongest) + " (cross-attention)", annotate=False)
            files.append(plots.save(fig, out_dir / f"cross_layer{i}.png"))
        decoder = ["<start>"] + target[:-1]  # what the decoder reads: row i predicts target word i
        n = len(seen["cross"])
        views = {
            "encoder self-attention": dict(weights=[w[0] for w in seen["encoder"]], tokens=source, layer_names=[f"encoder {i}" for i in range(n)]),
            "decoder self-attention (causal)": dict(weights=[w[0] for w in seen["decoder"]], tokens=decoder, mask=masks.causal(len(decoder)), layer_names=[f"decoder {i}" for i in range(n)]),
            "cross-attention (rows: the word each writes; the alignment)": dict(weights=[w[0] for w in seen["cross"]], tokens=target, key_tokens=source, layer_names=[f"cross {i}" for i in range(n)]),
        }
        files.append(explorer.write_views_html(out_dir / "heads.html", views, title=f"qkv train {args.task}: the three kinds of attention, learned"))
    else:
        _, _, weights = model.forward(x, want_weights=True)  # per layer (1, H, T, T)
        tokens = [str(t) for t in x[0]]
        T = len(tokens)
        for i, w in enumerate(weights):
            fig = plots.plot_attention(w[0], tokens, mask=masks.causal(T), title=tr.layer_title(args.task, i, len(weights), strongest), annotate=False)
            files.append(plots.save(fig, out_dir / f"heads_layer{i}.png"))
        files.append(explorer.write_html(out_dir / "heads.html", [w[0] for w in weights], tokens, mask=masks.causal(T), title=f"qkv train {args.task}: the learned heads"))
    result = {"task": args.task, "steps": res.steps, "accuracy": res.accuracy, "loss": res.loss, "seconds": round(res.seconds, 2),
              "heads": {name: np.round(s, 3).tolist() for name, s in scores.items()},
              "strongest": {name: {"layer": lay, "head": h, "score": round(sc, 3)} for name, (lay, h, sc) in strongest.items()},
              "files": [str(f) for f in files]}  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\nheld-out accuracy {res.accuracy:.4f}, loss {res.loss:.4f}, {res.seconds:.1f} s")
    for name, (layer, head, score) in strongest.items():
        print(f"strongest {name.replace('_', '-')} head: layer {layer} head {head} ({score:.2f} of its weight; layers and heads from 0)")
    print(f"wrote {len(files)} files:")
    for f in files:
        print(f"  {f}")
    return 0
