"""Pictures of attention (optional extra: ``pip install 'qkv[viz]'``).

Every function returns a :class:`matplotlib.figure.Figure` and, given
``path``, saves it (PNG or SVG, by the file's suffix). Figures are made
without ``pyplot``, so no window ever opens and no display is needed; in a
notebook, display the returned figure.
"""

from __future__ import annotations

import math
import contextlib
import functools
import re
import textwrap
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from ._checks import as_array
from ._files import write_atomic

try:
    import matplotlib
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator
except ImportError as exc:  # pragma: no cover - exercised through the CLI test with a blocked import
    raise ImportError("qkv.viz needs matplotlib: pip install 'qkv[viz]'") from exc

__all__ = [
    "plot_attention",
    "plot_position_encoding",
    "plot_embedding_shift",
    "plot_score_variance",
    "plot_training",
    "plot_block_mask",
    "pca_2d",
    "labelled_every",
    "save",
    "MAX_TICKS",
    "MAX_FIGURE_INCHES",
]


def __dir__():  # what dir() and tab completion list: the API, not the imports
    return sorted(__all__)

_MASKED_COLOR = "#d9d9d9"


def save(fig: Figure, path, *, dpi: int = 120) -> Path:
    """Save ``fig`` to ``path`` (.png or .svg), creating the folder; returns the path.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from matplotlib.figure import Figure
    >>> from qkv import viz
    >>> viz.save(Figure(), pathlib.Path(tempfile.mkdtemp()) / "sub" / "empty.png").name
    'empty.png'
    """
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"path should end in .png or .svg, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _fonts_for(fig):  # through a temporary file: a symbolic link at path is replaced, not written through
        write_atomic(path, lambda f: fig.savefig(f, dpi=dpi, format=path.suffix.lower()[1:]))
    return path


#: Fonts tried after matplotlib's default for characters it lacks (CJK, Arabic, Hebrew, ...).
FALLBACK_FONTS = ("Noto Sans CJK JP", "Noto Sans CJK SC", "Noto Sans", "Noto Sans Arabic", "Noto Sans Hebrew", "Droid Sans Fallback", "WenQuanYi Zen Hei", "Unifont")
_warned_glyphs = False


def _literal_text(plot):
    """``plot`` with every text it makes drawn as written: tokens and names come from texts and model
    files, and matplotlib reads a "$...$" in a label as math (a token "$\\frac$" failed the drawing;
    "$x^2$" was drawn as a formula). qkv's own labels use no math."""

    @functools.wraps(plot)
    def literal(*args, **kwargs):
        with matplotlib.rc_context({"text.parse_math": False}):
            return plot(*args, **kwargs)

    return literal


@contextlib.contextmanager
def _fonts_for(fig: Figure):
    """Draw with font fallback where the system has fonts for it; at most one warning for missing glyphs.

    Matplotlib warns once per missing character ("Glyph ... missing from
    font(s)"): a text in Chinese gives dozens. Those are gathered into one
    warning that says what to install.
    """
    global _warned_glyphs
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    families = [matplotlib.rcParams["font.sans-serif"][0], *[f for f in FALLBACK_FONTS if f in installed]]
    with warnings.catch_warnings(record=True) as caught, matplotlib.rc_context({"font.family": "sans-serif", "font.sans-serif": families, "text.parse_math": False}):
        warnings.simplefilter("always")
        yield
    missing = [w for w in caught if "Glyph" in str(w.message) and "missing" in str(w.message)]
    for w in caught:
        if w not in missing:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if missing and not _warned_glyphs:
        _warned_glyphs = True
        chars = dict.fromkeys(chr(int(m.group(1))) for w in missing if (m := re.search(r"Glyph (\d+)", str(w.message))))
        named = "".join(list(chars)[:8]) + ("..." if len(chars) > 8 else "")
        warnings.warn(
            f"characters with no glyph in the installed fonts are drawn as boxes ({named}); "
            "install a font that has them (e.g. Debian's fonts-noto-cjk) and qkv.viz uses it",
            UserWarning,
            stacklevel=3,
        )


def _finish(fig: Figure, path):
    if path is not None:
        save(fig, path)
    return fig


#: Most tick labels per axis; past it every k-th token is labelled, with its index.
MAX_TICKS = 40
#: The most inches a heatmap figure's panels take across (and down): larger PNGs are only ever seen shrunk.
MAX_FIGURE_INCHES = 16.0


def labelled_every(n: int) -> int:
    """Every how many tokens an axis of ``n`` tokens gets a label (1 up to :data:`MAX_TICKS` tokens).

    >>> labelled_every(40), labelled_every(501)
    (1, 13)
    """
    return max(1, math.ceil(n / MAX_TICKS))


def _ticks(n: int) -> list[int]:
    return list(range(0, n, labelled_every(n)))


def _labels(tokens, n: int, name: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name} should have {n} entries to match the weights, got {len(tokens)}")
    return tokens


@_literal_text
def plot_attention(
    weights,
    tokens: Sequence[str] | None = None,
    *,
    query_tokens: Sequence[str] | None = None,
    mask=None,
    head_names: Sequence[str] | None = None,
    title: str = "Attention weights",
    ncols: int | None = None,
    annotate: bool | None = None,
    scale: str = "linear",
    path=None,
) -> Figure:
    """Heatmaps of attention weights, one panel per head.

    Parameters
    ----------
    weights : array_like, shape (H, L, S) or (L, S)
        Rows are queries, columns keys.
    tokens : sequence of str, length S, optional
        Key tokens (x axis). Also the query tokens when ``query_tokens`` is
        not given and ``L == S``.
    query_tokens : sequence of str, length L, optional
    mask : array_like of bool, broadcastable to (H, L, S), optional
        Cells where the mask is ``False`` are drawn hatched grey, so a masked
        cell never looks like a weight of zero.
    head_names : sequence of str, length H, optional
        Panel titles (default "head 0", "head 1", ...).
    title : str
    ncols : int, optional
        Panels per row (default: a square-ish grid).
    annotate : bool, optional
        Write each weight in its cell (default: when the panels are small).
    scale : {"linear", "log"}
        Colour scale: linear on [0, 1], or logarithmic on [1e-4, 1], which
        shows the structure of long texts' weights (most of them are small).
    path : str or Path, optional
        Save the figure there (.png or .svg).

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import masks, viz
    >>> w = np.tril(np.full((2, 3, 3), 0.5))  # (H, L, S)
    >>> fig = viz.plot_attention(w, ["a", "b", "c"], mask=masks.causal(3))
    >>> [ax.get_title() for ax in fig.axes[:2]]
    ['head 0', 'head 1']
    """
    w = as_array(weights, "weights")
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights shape should be (H, L, S) or (L, S), got {w.shape}")
    H, L, S = w.shape
    keys = _labels(tokens, S, "tokens")
    queries = _labels(query_tokens if query_tokens is not None else (tokens if L == S else None), L, "query_tokens")
    keep = np.ones(w.shape, bool) if mask is None else np.broadcast_to(as_array(mask, "mask").astype(bool), w.shape)
    names = list(head_names) if head_names is not None else [f"head {h}" for h in range(H)]
    ncols = math.ceil(math.sqrt(H)) if ncols is None else ncols
    nrows = math.ceil(H / ncols)
    annotate = (L <= 12 and S <= 12) if annotate is None else annotate
    hatch = L * S <= 2500
    # Inches per cell: short texts get readable cells; longer ones get larger panels (up to 12
    # inches), so the figure grows with the text while tick labels stay at most MAX_TICKS an axis.
    n = max(L, S, 1)
    # At most MAX_FIGURE_INCHES across and down in all: past that a PNG is only seen shrunk, its labels unreadable.
    cell = min(0.42, max(4.5, min(12.0, 0.05 * n)) / n, MAX_FIGURE_INCHES / (ncols * S or 1), MAX_FIGURE_INCHES / (nrows * L or 1))
    # Room under and beside each panel for its tick labels (rotated tokens run down) and its title.
    def label_in(labels, n):  # inches a tick label takes along its text (8 points: about 0.07 inch a character)
        return min(1.6, 0.07 * (max(map(len, labels), default=1) + (4 if n > MAX_TICKS else 0)) + 0.1)

    x_label_in = label_in(keys, S)
    rotate = x_label_in > cell * labelled_every(S)  # key labels side by side would run together: stand them up
    below = (x_label_in if rotate else 0.15) + 0.3  # under a panel: its key labels
    beside = label_in(queries, L) + 0.3  # left of a panel: its query labels
    title_in = 0.09 * max(map(len, names), default=0) + 0.2  # a panel's title must not reach its neighbour's
    # Far more keys than queries (a decoder's few tokens over 1,500 audio positions): square cells would
    # make a strip a few pixels high; its rows get a readable height instead (cells no longer square).
    row = cell if S <= 8 * L else max(cell, min(0.3, 2.5 / max(L, 1)))
    fig = Figure(figsize=(ncols * max(S * cell + beside, title_in) + 1.8, nrows * (L * row + below + 0.35) + 0.9), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    if scale not in ("linear", "log"):
        raise ValueError(f"scale should be 'linear' or 'log', got {scale!r}")
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=_MASKED_COLOR, under=matplotlib.colormaps["viridis"](0.0))
    norm = LogNorm(vmin=1e-4, vmax=1.0, clip=False) if scale == "log" else Normalize(vmin=0.0, vmax=1.0)
    image = None
    for h, ax in enumerate(axes):
        if h >= H:
            ax.set_axis_off()
            continue
        data = np.ma.masked_array(w[h], mask=~keep[h])
        image = ax.imshow(data, cmap=cmap, norm=norm, aspect="equal" if row == cell else "auto", interpolation="nearest")
        if hatch:  # hatch masked cells: "not allowed", not "weight 0" (large panels: the grey alone)
            ys, xs = np.nonzero(~keep[h])
            for y, x in zip(ys, xs):
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#8c8c8c", linewidth=0))
        if annotate:
            for y in range(L):
                for x in range(S):
                    if keep[h, y, x]:
                        v = w[h, y, x]
                        ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
        ax.set_title(names[h], fontsize=10)
        xt, yt = _ticks(S), _ticks(L)  # at most MAX_TICKS labels per axis: long texts stay legible and fast
        ax.set_xticks(xt, [keys[i] if S <= MAX_TICKS else f"{i} {keys[i]}" for i in xt], rotation=90 if rotate else 0, fontsize=8)
        ax.set_yticks(yt, [queries[i] if L <= MAX_TICKS else f"{queries[i]} {i}" for i in yt], fontsize=8)
        if H == 1:
            ax.set_xlabel("key (attended to)", fontsize=8)
            ax.set_ylabel("query (attending)", fontsize=8)
    if H > 1:  # once for the figure: a label under every panel would run into the titles of the row below
        fig.supxlabel("key (attended to)", fontsize=9)
        fig.supylabel("query (attending)", fontsize=9)
    fig.colorbar(image, ax=axes[:H].tolist(), shrink=0.8, label="attention weight" + (" (log scale)" if scale == "log" else ""), extend="min" if scale == "log" else "neither")
    if not keep.all():
        fig.legend(handles=[Patch(facecolor=_MASKED_COLOR, hatch="///", edgecolor="#8c8c8c", label="masked (may not attend)")], loc="outside lower right", fontsize=8)
    fig.suptitle(title)
    return _finish(fig, path)


@_literal_text
def plot_position_encoding(table, *, title: str = "Sinusoidal position encoding", path=None) -> Figure:
    """The ``(L, E)`` position-encoding table as a heatmap (positions down, dimensions across).

    Parameters
    ----------
    table : array_like, shape (L, E)
    title : str
    path : str or Path, optional

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> from qkv import sinusoidal_position_encoding, viz
    >>> viz.plot_position_encoding(sinusoidal_position_encoding(16, 8)).axes[0].get_ylabel()
    'position in the sequence'
    """
    pe = as_array(table, "table")
    if pe.ndim != 2:
        raise ValueError(f"table shape should be (L, E), got {pe.shape}")
    L, E = pe.shape
    fig = Figure(figsize=(min(12, max(7, 3 + E * 0.12)), min(8, max(4, 2.5 + L * 0.06))), layout="constrained")
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    image = ax.imshow(pe, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_xlabel("encoding dimension (even: sin, odd: cos; frequency falls to the right)")
    ax.set_ylabel("position in the sequence")
    ax.set_title(f"{title}, {L} positions x {E} dims")
    fig.colorbar(image, ax=ax, label="value")
    return _finish(fig, path)


def pca_2d(*arrays) -> list[np.ndarray]:
    """Project arrays of shape (N_i, E) onto the top two principal axes of all of them together.

    Returns one (N_i, 2) array per input, in a shared coordinate system.

    Examples
    --------
    >>> import numpy as np
    >>> from qkv.viz import pca_2d
    >>> a, b = pca_2d(np.eye(3), 2 * np.eye(3))
    >>> a.shape, b.shape
    ((3, 2), (3, 2))
    """
    xs = [as_array(a, f"arrays[{i}]").astype(np.float64) for i, a in enumerate(arrays)]
    if not xs or any(x.ndim != 2 for x in xs) or len({x.shape[1] for x in xs}) != 1:
        raise ValueError(f"arrays should be 2-D with the same number of columns, got {[x.shape for x in xs]}")
    allx = np.concatenate(xs)
    center = allx.mean(0)
    _, _, vt = np.linalg.svd(allx - center, full_matrices=False)  # rows of vt: principal axes
    axes = vt[:2].T  # (E, 2)
    if axes.shape[1] < 2:
        axes = np.pad(axes, ((0, 0), (0, 2 - axes.shape[1])))
    return [(x - center) @ axes for x in xs]


@_literal_text
def plot_embedding_shift(
    original,
    contextual,
    tokens: Sequence[str],
    *,
    title: str = "How attention moves word embeddings",
    path=None,
) -> Figure:
    """Original vs contextual embeddings in 2-D (PCA), with an arrow per token.

    Both sets are projected with the same PCA, fitted on the two together, so
    the arrows show how attention moved each token.

    Parameters
    ----------
    original : array_like, shape (L, E)
        Embeddings before attention.
    contextual : array_like, shape (L, E)
        Embeddings after attention (same E).
    tokens : sequence of str, length L
    title : str
    path : str or Path, optional

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> import numpy as np
    >>> from qkv import viz
    >>> x = np.random.default_rng(0).standard_normal((3, 4))
    >>> viz.plot_embedding_shift(x, x + 1, ["a", "b", "c"]).axes[0].get_xlabel()
    'principal component 1'
    """
    o, c = as_array(original, "original"), as_array(contextual, "contextual")
    if o.shape != c.shape or o.ndim != 2:
        raise ValueError(f"original and contextual should both be (L, E), got {o.shape} and {c.shape}")
    labels = _labels(tokens, o.shape[0], "tokens")
    o2, c2 = pca_2d(o, c)
    fig = Figure(figsize=(8, 6.5), layout="constrained")
    ax = fig.add_subplot()
    for i in range(len(labels)):
        ax.annotate("", xy=c2[i], xytext=o2[i], arrowprops=dict(arrowstyle="->", color="#7f7f7f", lw=1.2, alpha=0.8))
    ax.scatter(*o2.T, color="#1f77b4", s=40, label="original (static) embedding", zorder=3)
    ax.scatter(*c2.T, color="#d62728", s=40, marker="s", label="contextual (after attention)", zorder=3)
    # The same word in two places has one static point: label it once, with every name it stands for.
    # A word in two places with two static points (a position encoding added, say) gets its
    # position in each label, so the two are told apart ("the #0", "the #6").
    at: dict[tuple, list[int]] = {}
    for i in range(len(labels)):
        at.setdefault(tuple(np.round(o2[i], 6)), []).append(i)
    point = {i: key for key, idx in at.items() for i in idx}  # each token's static point
    shown = [f"{t} #{i}" if len({point[j] for j, u in enumerate(labels) if u == t}) > 1 else t for i, t in enumerate(labels)]
    texts = [(c2[i], shown[i], "#d62728") for i in range(len(labels))]
    texts += [(o2[idx[0]], ", ".join(dict.fromkeys(shown[i] for i in idx)), "#1f77b4") for idx in at.values()]
    if len(labels) > MAX_TICKS:  # too many to read: the first place of each distinct word, at most MAX_TICKS
        first = {}
        for i, t in enumerate(labels):
            first.setdefault(t, i)
        keep = sorted(first.values())[: MAX_TICKS // 2]
        texts = [(c2[i], labels[i], "#d62728") for i in keep] + [(o2[i], labels[i], "#1f77b4") for i in keep]
        ax.text(0.99, 0.01, f"labelled: the first place of {len(keep)} of the {len(labels)} tokens", transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="#555555")
    # Everything drawn so far is an obstacle for the labels: the points and the arrows between them.
    along = np.linspace(0.15, 0.85, 6)[:, None, None]
    obstacles = np.concatenate([o2, c2, (o2 + along * (c2 - o2)).reshape(-1, 2)])
    for (xy, t, color), offset in zip(texts, _label_offsets(fig, ax, np.array([p for p, _, _ in texts]), [t for _, t, _ in texts], obstacles)):
        ax.annotate(t, xy, xytext=offset, textcoords="offset points", color=color, fontsize=9,
                    arrowprops=dict(arrowstyle="-", color=color, lw=0.5, alpha=0.5) if np.hypot(*offset) > 14 else None)
    ax.set_xlabel("principal component 1")
    ax.set_ylabel("principal component 2")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    ax.set_title(textwrap.fill(title, 80))  # a long title wraps instead of running off the figure
    return _finish(fig, path)


def _label_offsets(fig: Figure, ax, points: np.ndarray, texts: list[str], obstacles: np.ndarray, fontsize: float = 9) -> list[tuple]:
    """Offsets (in points) that keep labels off each other and off the markers: a greedy search, label by label.

    Each label tries positions around its point, nearest first, and takes the
    first whose box (measured by the renderer) overlaps no label placed before
    it and no obstacle (a marker, or a point along an arrow); a leader line
    joins a label moved far from its point. Labels are placed in order of
    crowding (the points with most neighbours first), so the hardest get
    the nearest places.
    """
    from matplotlib.font_manager import FontProperties

    ax.set_xlim(ax.get_xlim())  # fix the view so data -> points is known
    ax.set_ylim(ax.get_ylim())
    fig.draw_without_rendering()  # the constrained layout places the axes
    if not hasattr(fig.canvas, "get_renderer"):  # a Figure made without pyplot: give it Agg's canvas to measure text
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    to_pts = lambda xy: ax.transData.transform(xy) * 72.0 / fig.dpi  # noqa: E731  (data -> points)
    pts, obs = to_pts(points), to_pts(obstacles)  # (N, 2), (M, 2)
    pad = 2.0  # points of clearance around a label
    marker = 4.5  # half the side of a marker's box, in points (scatter s=40: about 6.3 points across)
    sizes = []  # (width, height, descent) of each label with its clearance, in points
    with _fonts_for(fig):  # measured in the fonts the labels are drawn in (the fallbacks too), a missing glyph said once
        font = FontProperties(size=fontsize)
        for t in texts:
            w, h, d = (v * 72.0 / fig.dpi for v in renderer.get_text_width_height_descent(t, font, ismath=False))
            sizes.append((w + 2 * pad, h + 2 * pad, d + pad))
    near = marker + 1.5  # just off the label's own marker
    candidates = [(near, 2), (near, -12), (-near, 2), (-near, -12), (near, -5), (-near, -5)] + [(r * np.cos(a), r * np.sin(a)) for r in (16, 26, 38, 52, 68) for a in np.linspace(0, 2 * np.pi, 16, endpoint=False)]
    (ax0, ay0), (ax1, ay1) = ax.get_window_extent().get_points() * 72.0 / fig.dpi  # labels stay inside the axes
    crowd = np.argsort(-(np.hypot(*(pts[:, None] - pts[None]).transpose(2, 0, 1)) < 40).sum(1), kind="stable")
    placed = []
    out = [None] * len(texts)
    for k in crowd:  # (dx, dy): where the text's baseline starts (dx > 0) or ends (dx < 0) from its point
        (x, y), (w, h, d) = pts[k], sizes[k]
        choice, best = None, None
        for dx, dy in candidates:
            x0 = x + dx - (w if dx < 0 else 0)
            box = (x0, y + dy - d, x0 + w, y + dy - d + h)
            hits = sum(not (box[2] <= b[0] or box[0] >= b[2] or box[3] <= b[1] or box[1] >= b[3]) for b in placed)
            hits += 100 * (box[0] < ax0 or box[2] > ax1 or box[1] < ay0 or box[3] > ay1)
            hits += int(np.sum((obs[:, 0] + marker > box[0]) & (obs[:, 0] - marker < box[2]) & (obs[:, 1] + marker > box[1]) & (obs[:, 1] - marker < box[3])))
            if best is None or hits < best:
                choice, best = (dx, dy), hits
            if hits == 0:
                break
        dx, dy = choice
        x0 = x + dx - (w if dx < 0 else 0)
        placed.append((x0, y + dy - d, x0 + w, y + dy - d + h))
        out[k] = (x0 - x + pad, dy)  # the text itself starts inside its clearance
    return out


@_literal_text
def plot_score_variance(stats: dict, *, title: str = "Why scale the scores by 1/sqrt(D)", path=None) -> Figure:
    """Score variance and softmax peakedness vs head dim, unscaled vs scaled.

    Parameters
    ----------
    stats : dict
        The result of :func:`qkv.scaling.score_statistics`.
    title : str
    path : str or Path, optional

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> from qkv import viz
    >>> from qkv.scaling import score_statistics
    >>> len(viz.plot_score_variance(score_statistics([2, 8], samples=50, rng=0)).axes)
    2
    """
    d = np.asarray(stats["dim"])
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(d, stats["unscaled_var"], "o-", color="#d62728", label="unscaled  q . k")
    left.plot(d, stats["scaled_var"], "s-", color="#1f77b4", label="scaled  q . k / sqrt(D)")
    left.plot(d, d, ":", color="#7f7f7f", label="D (theory, unscaled)")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xlabel("head dim D")
    left.set_ylabel("variance of the scores")
    left.set_title("Score variance grows with D unless scaled")
    left.legend(fontsize=8)
    left.grid(True, alpha=0.3)
    right.plot(d, stats["unscaled_max_weight"], "o-", color="#d62728", label="unscaled")
    right.plot(d, stats["scaled_max_weight"], "s-", color="#1f77b4", label="scaled")
    right.set_xscale("log", base=2)
    right.set_ylim(0, 1.02)
    right.set_xlabel("head dim D")
    right.set_ylabel("mean of the largest softmax weight")
    right.set_title("Unscaled softmax saturates: one key takes all")
    right.legend(fontsize=8)
    right.grid(True, alpha=0.3)
    fig.suptitle(title)
    return _finish(fig, path)


@_literal_text
def plot_training(history, *, title: str = "Training", path=None) -> Figure:
    """Loss and accuracy over training steps, from ``qkv.train``'s history of (step, loss, accuracy).

    Examples
    --------
    >>> from qkv import viz
    >>> fig = viz.plot_training([(10, 2.0, 0.1), (20, 1.0, 0.6), (30, 0.1, 0.99)])
    >>> [ax.get_ylabel() for ax in fig.axes]
    ['cross-entropy (log scale)', 'accuracy on the scored positions']
    """
    h = np.asarray(history, dtype=float)
    if h.ndim != 2 or h.shape[1] != 3 or not len(h):
        raise ValueError(f"history should be a list of (step, loss, accuracy), got shape {h.shape}")
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(h[:, 0], h[:, 1], "-", color="#d62728")
    left.set_yscale("log")
    left.set_xlabel("step")
    left.set_ylabel("cross-entropy (log scale)")
    left.grid(True, which="both", alpha=0.3)
    right.plot(h[:, 0], h[:, 2], "-", color="#1f77b4")
    right.set_ylim(0, 1.02)
    right.set_xlabel("step")
    right.set_ylabel("accuracy on the scored positions")
    right.grid(True, alpha=0.3)
    fig.suptitle(title)
    return _finish(fig, path)


@_literal_text
def plot_block_mask(block_mask, *, batch: int = 0, head: int = 0, title: str | None = None, path=None) -> Figure:
    """A block mask's tiles for one batch entry and head: skipped (empty), masked (partial), computed whole (full).

    Parameters
    ----------
    block_mask : qkv.mods.BlockMask
    batch, head : int
        Which one to draw (index 0 of a mask that does not depend on it).
    title : str, optional
    path : str or Path, optional

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> from qkv import mods, viz
    >>> bm = mods.create_block_mask(mods.causal(), None, None, 256, 256, block=64)
    >>> viz.plot_block_mask(bm).axes[0].get_title()
    'tiles of 64 x 64: 6 skipped (empty), 4 masked (partial), 6 full'
    """
    from matplotlib.colors import ListedColormap

    kinds = block_mask.kinds
    k = kinds[0 if kinds.shape[0] == 1 else batch, 0 if kinds.shape[1] == 1 else head]  # (nq, nk)
    c = {"empty": int((k == 0).sum()), "partial": int((k == 1).sum()), "full": int((k == 2).sum())}
    nq, nk = k.shape
    side = min(7.0, max(3.0, 0.25 * max(nq, nk)))
    fig = Figure(figsize=(side + 1.8, side * nq / max(nk, 1) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(k, cmap=ListedColormap(["#f0f0f0", "#f4a261", "#2a9d8f"]), vmin=0, vmax=2, interpolation="nearest", aspect="equal")
    ax.set_xlabel(f"key tile ({block_mask.block_kv} keys each)")
    ax.set_ylabel(f"query tile ({block_mask.block_q} queries each)")
    ax.set_title(textwrap.fill(title or f"tiles of {block_mask.block_q} x {block_mask.block_kv}: {c['empty']} skipped (empty), {c['partial']} masked (partial), {c['full']} full", 72), fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.legend(handles=[Patch(facecolor=col, edgecolor="#999999", label=lab) for col, lab in (("#f0f0f0", "empty: skipped"), ("#f4a261", "partial: masked in part"), ("#2a9d8f", "full: no mask"))],
               loc="outside lower center", ncols=3, fontsize=8)  # fmt: skip
    return _finish(fig, path)
