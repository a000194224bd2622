"""An attention explorer in the browser: one self-contained HTML file.

:func:`write_html` turns attention weights (one head, one layer's heads, or
every layer's) into a single ``.html`` page with the data and the script
inline: no server, no CDN, no network, it opens from ``file://``. It needs
only NumPy to write and a browser to read. The page has three views:

* **head view**: query tokens on the left, key tokens on the right, a line
  from each query to each key it attends to, its opacity the weight, one
  colour per head; hover a token to keep only its lines;
* **model view**: a small heatmap per layer and head; click one to open it;
* **matrix view**: one head as a zoomable heatmap on a canvas, readable for
  hundreds of tokens, with the exact weight under the pointer.

Masked pairs (causal, padding, window) are absent from the head view and
grey in the heatmaps, so a masked pair never looks like a weight of zero.

Shapes: N layers, H heads, L queries, S keys.

:func:`write_views_html` puts several explorers on one page, side by side:
an encoder-decoder's three kinds of attention (encoder, decoder and cross),
as bertviz's ``model_view(encoder_attention=, decoder_attention=,
cross_attention=)`` shows them. Each is a whole explorer in its own frame.

How the weights travel: each is stored as a 16-bit code ``round(w * 65534)``
(65535 marks a masked pair), an absolute error of at most 7.7e-6, then
deflated and base64-encoded; the page inflates them with the browser's own
``DecompressionStream``. The script is ``explorer.js`` beside this module,
short and commented: read it to see how the views are drawn.
"""

from __future__ import annotations

import base64
import html
import json
import re
import zlib
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np

from ._checks import as_array, as_bool_mask
from ._files import write_atomic

__all__ = ["render_html", "write_html", "render_views", "write_views_html", "stack_weights"]

#: The largest 16-bit code of a weight; MASKED_CODE marks a masked pair.
SCALE_CODE = 65534
MASKED_CODE = 65535
#: Weights below this are not drawn as lines in the head view (the page has a slider).
DEFAULT_THRESHOLD = 0.01
#: How far a weight may stray outside [0, 1] (float rounding of a softmax) before it is refused.
_TOLERANCE = 1e-3


def __dir__():
    return sorted(__all__)


def stack_weights(weights) -> np.ndarray:
    """Attention weights as one ``(N, H, L, S)`` array.

    Parameters
    ----------
    weights : array_like, (L, S), (H, L, S) or (N, H, L, S); a sequence of N
        per-layer arrays (H, L, S) (what the encoders' and decoders'
        ``attentions`` hold once their batch index is taken); or an
        :class:`qkv.AttentionTrace` of one unbatched call.

    Returns
    -------
    ndarray, (N, H, L, S)
    """
    trace_weights = getattr(weights, "weights", None)
    if trace_weights is not None and hasattr(weights, "scaled_scores"):  # an AttentionTrace
        weights = trace_weights
    if isinstance(weights, (list, tuple)) and weights and all(hasattr(w, "shape") for w in weights):
        shapes = {np.shape(w) for w in weights}
        if len(shapes) != 1:
            raise ValueError(f"weights: every layer should have the same (H, L, S) shape, got {sorted(shapes)}")
    w = as_array(weights, "weights")
    if w.dtype.kind not in "fiub":
        raise TypeError(f"weights should be a float array, got dtype {w.dtype}")
    if not 2 <= w.ndim <= 4:
        raise ValueError(f"weights shape should be (L, S), (H, L, S) or (N, H, L, S), got {w.shape}")
    return w.reshape((1,) * (4 - w.ndim) + w.shape).astype(np.float64, copy=False)


def _names(given, n: int, kind: str) -> list[str]:
    if given is None:
        return [f"{kind} {i}" for i in range(n)]
    names = [str(s) for s in given]
    if len(names) != n:
        raise ValueError(f"{kind}_names should have {n} entries (one per {kind}), got {len(names)}")
    return names


def _tokens(given, n: int, name: str) -> list[str]:
    if isinstance(given, str):
        raise TypeError(f"{name} should be a sequence of token strings, got a str")
    tokens = [str(t) for t in given]
    if len(tokens) != n:
        raise ValueError(f"{name} should have {n} entries to match the weights, got {len(tokens)}")
    return tokens


def _encode(w: np.ndarray, keep: np.ndarray) -> str:
    """16-bit codes of the weights (MASKED_CODE where masked), deflated, base64."""
    codes = np.rint(np.clip(w, 0.0, 1.0) * SCALE_CODE).astype("<u2")
    codes[~keep] = MASKED_CODE
    return base64.b64encode(zlib.compress(codes.tobytes(), 6)).decode("ascii")


def render_html(
    weights,
    tokens: Sequence[str],
    *,
    key_tokens: Sequence[str] | None = None,
    mask=None,
    layer_names: Sequence[str] | None = None,
    head_names: Sequence[str] | None = None,
    title: str = "qkv attention explorer",
    layer: int | None = None,
    head: int | None = None,
    scale: str = "linear",
    threshold: float = DEFAULT_THRESHOLD,
) -> str:
    """The explorer page for ``weights``, as a string (see :func:`write_html`)."""
    w = stack_weights(weights)  # (N, H, L, S)
    N, H, L, S = w.shape
    if w.size == 0:
        raise ValueError(f"weights should not be empty, got shape {w.shape}")
    queries = _tokens(tokens, L, "tokens")
    if key_tokens is None:
        if S != L:
            raise ValueError(f"weights have {L} queries and {S} keys: give key_tokens (length {S}) as well as tokens")
        keys = queries
    else:
        keys = _tokens(key_tokens, S, "key_tokens")
    if not np.isfinite(w).all():
        bad = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"weights should be finite, got {w[tuple(bad)]} at (layer, head, query, key) = {tuple(int(i) for i in bad)}")
    lo, hi = float(w.min()), float(w.max())
    if lo < -_TOLERANCE or hi > 1 + _TOLERANCE:
        raise ValueError(f"weights should be attention probabilities in [0, 1], got values in [{lo:.4g}, {hi:.4g}]")
    keep = np.ones(w.shape, dtype=bool)
    if mask is not None:
        m = as_bool_mask(mask)
        try:
            keep = np.broadcast_to(m.reshape((1,) * max(0, 4 - m.ndim) + m.shape), w.shape)
        except ValueError:
            raise ValueError(f"mask shape should broadcast to the weights' (N, H, L, S) = {w.shape}, got {m.shape}") from None
        leaked = np.abs(np.where(keep, 0.0, w)).max()
        if leaked > _TOLERANCE:
            raise ValueError(f"weights are non-zero (up to {leaked:.3g}) where mask is False: the mask does not belong to these weights")
    if scale not in ("linear", "log"):
        raise ValueError(f"scale should be 'linear' or 'log', got {scale!r}")
    if not 0 <= threshold < 1:
        raise ValueError(f"threshold should be in [0, 1), got {threshold}")
    layer = N - 1 if layer is None else layer
    if not 0 <= layer < N:
        raise ValueError(f"layer should be in [0, {N - 1}], got {layer}")
    if head is not None and not 0 <= head < H:
        raise ValueError(f"head should be in [0, {H - 1}], got {head}")
    data = {
        "title": str(title),
        "shape": [N, H, L, S],
        "layers": _names(layer_names, N, "layer"),
        "heads": _names(head_names, H, "head"),
        "queryTokens": queries,
        "keyTokens": keys,
        "initial": {"layer": int(layer), "head": None if head is None else int(head), "scale": scale, "threshold": float(threshold)},
        "scaleCode": SCALE_CODE,
        "maskedCode": MASKED_CODE,
        "codes": _encode(w, keep),
    }
    # "<" escaped so no token can close the <script> element that holds the data.
    blob = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    page = resources.files(__package__).joinpath("explorer.html").read_text("utf-8")
    script = resources.files(__package__).joinpath("explorer.js").read_text("utf-8")
    fill = {"TITLE": html.escape(str(title)), "DATA": blob, "SCRIPT": script}
    return re.sub(r"\{\{(TITLE|DATA|SCRIPT)\}\}", lambda m: fill[m.group(1)], page)  # one pass: no filling is read twice


def write_html(path, weights, tokens: Sequence[str], **options) -> Path:
    """Write the attention explorer for ``weights`` to one self-contained ``.html`` file.

    Parameters
    ----------
    path : str or Path
        Where to write the page; its folder must exist. Written atomically:
        every check runs first, and a failed write leaves no file behind.
    weights : array_like, (L, S), (H, L, S) or (N, H, L, S), a sequence of
        (H, L, S) arrays, or an AttentionTrace
        Attention probabilities (each row sums to 1, or 0 where all is masked).
    tokens : sequence of str, length L
        Query tokens (and key tokens when ``key_tokens`` is not given).
    key_tokens : sequence of str, length S, optional
    mask : array_like of bool, broadcastable to (N, H, L, S), optional
        True = may attend. Masked pairs are drawn as absent, not as zero.
    layer_names, head_names : sequence of str, optional
        Labels (default "layer 0", "head 0", ...).
    title : str
    layer, head : int, optional
        What the page opens on (default: the last layer, every head).
    scale : {"linear", "log"}
        The heatmaps' initial colour scale (the page can switch).
    threshold : float
        Lines for weights below it are not drawn in the head view (default
        0.01; the page has a slider).

    Returns
    -------
    Path
        The written file.

    Raises
    ------
    ValueError, TypeError
        Weights that are not finite probabilities, tokens or a mask that do
        not match them, before anything is written.
    OSError
        The file cannot be written.

    Examples
    --------
    >>> import numpy as np, tempfile, pathlib
    >>> from qkv import masks, explorer, softmax
    >>> w = softmax(np.random.default_rng(0).normal(size=(2, 3, 3)), where=masks.causal(3))  # (H, L, S)
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "attention.html"
    >>> explorer.write_html(out, w, ["the", "cat", "sat"], mask=masks.causal(3)).name
    'attention.html'
    >>> page = out.read_text()
    >>> " src=" in page or " href=" in page  # nothing to fetch: data and script are inline
    False
    """
    return _write_page(path, lambda: render_html(weights, tokens, **options))


def _write_page(path, render) -> Path:
    """Check ``path``, render the page (every check of the data runs here), then write it atomically."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"path should end in .html, got {str(path)!r}")
    if not path.parent.is_dir():
        raise OSError(f"cannot write {str(path)!r}: folder {str(path.parent)!r} does not exist")
    page = render().encode("utf-8")
    try:
        return write_atomic(path, lambda f: f.write(page))
    except OSError as exc:
        raise OSError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


def render_views(views: dict, *, title: str = "qkv attention explorer") -> str:
    """One page of several explorers side by side: ``views`` maps a heading to the keyword arguments of
    :func:`render_html` (``weights``, ``tokens``, ``key_tokens``, ...). Each view is checked as
    :func:`render_html` checks it, then framed (``<iframe srcdoc>``: its script and ids stay its own)."""
    if not isinstance(views, dict) or not views:
        raise ValueError(f"views should be a non-empty dict of heading -> render_html arguments, got {type(views).__name__}")
    frames = []
    for heading, options in views.items():
        if not isinstance(options, dict) or "weights" not in options or "tokens" not in options:
            raise ValueError(f"views[{heading!r}] should be a dict with at least 'weights' and 'tokens'")
        opts = dict(options)
        page = render_html(opts.pop("weights"), opts.pop("tokens"), **{"title": str(heading), **opts})
        frames.append(f'<iframe title="{html.escape(str(heading), quote=True)}" srcdoc="{html.escape(page, quote=True)}"></iframe>')  # the frame shows the heading
    style = ("body{font-family:system-ui,sans-serif;margin:12px}main{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:12px}"
             "iframe{width:100%;height:860px;border:1px solid #ccc}")  # fmt: skip
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{style}</style></head>'
            f'<body><h1 style="font-size:18px">{html.escape(title)}</h1><main>{"".join(frames)}</main></body></html>')  # fmt: skip


def write_views_html(path, views: dict, *, title: str = "qkv attention explorer") -> Path:
    """Write :func:`render_views`'s page to ``path`` (``.html``), atomically, every view checked first.

    Examples
    --------
    >>> import numpy as np, tempfile, pathlib
    >>> from qkv import masks, explorer, softmax
    >>> rng = np.random.default_rng(0)
    >>> enc = softmax(rng.normal(size=(2, 3, 3)))                                   # (H, S, S)
    >>> dec = softmax(rng.normal(size=(2, 2, 2)), where=masks.causal(2))            # (H, T, T)
    >>> cross = softmax(rng.normal(size=(2, 2, 3)))                                 # (H, T, S)
    >>> src, tgt = ["le", "chat", "noir"], ["the", "cat"]
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "three.html"
    >>> explorer.write_views_html(out, {"encoder": dict(weights=enc, tokens=src), "decoder": dict(weights=dec, tokens=tgt, mask=masks.causal(2)),
    ...                                 "cross": dict(weights=cross, tokens=tgt, key_tokens=src)}).name
    'three.html'
    >>> out.read_text().count("<iframe")
    3
    """
    return _write_page(path, lambda: render_views(views, title=title))
