"""Pictures: files are written, are valid images of the expected size, and are not blank."""

import numpy as np
import pytest

import matplotlib.image as mpimg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from qkv import masks, sinusoidal_position_encoding, viz  # noqa: E402
from qkv.scaling import score_statistics  # noqa: E402


def check_png(path, fig):
    img = mpimg.imread(path)  # (rows, cols, channels), floats in [0, 1]
    w_in, h_in = fig.get_size_inches()
    # saved at 120 dpi (matplotlib truncates a fractional pixel: within one of the rounded size)
    assert abs(img.shape[0] - h_in * 120) <= 1 and abs(img.shape[1] - w_in * 120) <= 1
    rgb = img[..., :3]
    assert rgb.std() > 0.05, "image is blank"
    assert len(np.unique(rgb.reshape(-1, 3).round(2), axis=0)) > 20, "image has almost no colours"
    return img


def test_attention_heatmap_grid(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.dirichlet(np.ones(5), size=(3, 5))  # (H, L, S)
    keep = masks.causal(5)
    w = np.where(keep, w, 0)
    fig = viz.plot_attention(w, ["a", "b", "c", "d", "e"], mask=keep, path=tmp_path / "att.png")
    assert isinstance(fig, Figure)
    assert len([ax for ax in fig.axes if ax.get_title().startswith("head")]) == 3
    img = check_png(tmp_path / "att.png", fig)
    # masked cells are hatched grey, unlike a weight of 0 (viridis' dark purple)
    masked_grey = np.array([0xD9, 0xD9, 0xD9]) / 255
    assert (np.abs(img[..., :3] - masked_grey).max(-1) < 0.02).mean() > 0.01
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["a", "b", "c", "d", "e"]


def test_svg_and_unbatched_weights(tmp_path):
    fig = viz.plot_attention(np.full((2, 3), 1 / 3), ["x", "y", "z"], query_tokens=["p", "q"], path=tmp_path / "a.svg")
    text = (tmp_path / "a.svg").read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert isinstance(fig, Figure)


def test_position_encoding_picture(tmp_path):
    fig = viz.plot_position_encoding(sinusoidal_position_encoding(50, 32), path=tmp_path / "pe.png")
    check_png(tmp_path / "pe.png", fig)


def test_embedding_shift_picture_and_pca(tmp_path):
    rng = np.random.default_rng(1)
    o, c = rng.standard_normal((6, 16)), rng.standard_normal((6, 16))
    fig = viz.plot_embedding_shift(o, c, list("abcdef"), path=tmp_path / "pca.png")
    check_png(tmp_path / "pca.png", fig)
    # PCA in 2-D keeps the two largest directions: compare with numpy's covariance eigenvectors
    x = np.concatenate([o, c])
    p_o, p_c = viz.pca_2d(o, c)
    proj = np.concatenate([p_o, p_c])
    eigvals = np.linalg.eigvalsh(np.cov(x.T))[::-1]
    np.testing.assert_allclose(proj.var(0, ddof=1), eigvals[:2], rtol=1e-10)


def test_score_variance_picture(tmp_path):
    stats = score_statistics([2, 8, 32], samples=200, rng=0)
    fig = viz.plot_score_variance(stats, path=tmp_path / "var.png")
    check_png(tmp_path / "var.png", fig)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: viz.plot_attention(np.ones((2, 2, 2, 2))), r"weights shape should be \(H, L, S\) or \(L, S\), got \(2, 2, 2, 2\)"),
        (lambda: viz.plot_attention(np.ones((2, 3)), ["a", "b"]), "tokens should have 3 entries to match the weights, got 2"),
        (lambda: viz.plot_embedding_shift(np.ones((3, 4)), np.ones((3, 5)), "abc"), r"original and contextual should both be \(L, E\), got \(3, 4\) and \(3, 5\)"),
        (lambda: viz.save(Figure(), "x.jpg"), "path should end in .png or .svg, got 'x.jpg'"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ long and non-Latin inputs
def _tick_count(fig):
    return max(max(len(ax.get_xticks()), len(ax.get_yticks())) for ax in fig.axes if ax.get_xticks() is not None)


def test_long_inputs_bound_the_labels_and_grow_the_figure():
    rng = np.random.default_rng(0)
    sizes = {}
    for n in (10, 60, 300):
        w = viz.plot_attention(rng.dirichlet(np.ones(n), size=(2, n)), [f"w{i}" for i in range(n)], scale="log")
        assert _tick_count(w) <= viz.MAX_TICKS
        sizes[n] = w.get_size_inches()[0]
    assert sizes[10] < sizes[60] < sizes[300]
    assert "log scale" in w.axes[-1].get_ylabel()


def test_missing_glyphs_give_one_warning_at_most(tmp_path, monkeypatch):
    import warnings

    monkeypatch.setattr(viz, "_warned_glyphs", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2):
            fig = viz.plot_attention(np.full((1, 3, 3), 1 / 3), ["日本語", "中文", "한국어"])
            viz.save(fig, tmp_path / f"cjk{i}.png")
        # The PCA picture measures its labels while it places them, before it is saved.
        x = np.random.default_rng(0).standard_normal((3, 4))
        viz.save(viz.plot_embedding_shift(x, x + 1, ["日本", "語", "한국어"]), tmp_path / "pca.png")
    glyph = [w for w in caught if "glyph" in str(w.message).lower()]
    assert len(glyph) <= 1, [str(w.message) for w in glyph]  # one, saying what to install, where no installed font has them; none where one does
    assert all("drawn as boxes (日本" in str(w.message) and "install a font" in str(w.message) for w in glyph)  # the characters named, once each


def _label_boxes(fig):
    """The text boxes of a PCA picture's labels (the text alone, not its leader line), drawn."""
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer() if hasattr(fig.canvas, "get_renderer") else None
    if renderer is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text() and t.get_position() != (0.99, 0.01)]
    return ax, renderer, [(t.get_text(), Text.get_window_extent(t, renderer)) for t in labels]


def check_labels_clear(fig, points):
    """No label overlaps another, covers a marker, or leaves the axes; every label names one token."""
    ax, renderer, boxes = _label_boxes(fig)
    overlaps = [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1 :] if ba.overlaps(bb)]
    assert overlaps == []
    marker = 3.0 * fig.dpi / 72  # half a scatter marker (s=40: 6.3 points across), in pixels
    pix = ax.transData.transform(points)
    covered = [(t, tuple(p)) for t, b in boxes for p in pix if b.x0 < p[0] + marker and b.x1 > p[0] - marker and b.y0 < p[1] + marker and b.y1 > p[1] - marker]
    assert covered == []
    inside = ax.get_window_extent(renderer)
    assert all(inside.x0 <= b.x0 and b.x1 <= inside.x1 and inside.y0 <= b.y0 and b.y1 <= inside.y1 for _, b in boxes)
    return [t for t, _ in boxes]


def test_pca_labels_do_not_overlap():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((12, 16))
    x[6] = x[0]  # the same word twice: one static point, two contextual ones
    tokens = ["i", "sat", "on", "the", "river", "bank", "bank", "cash", "at", "the", "money", "bank"]
    c = x + 0.05 * rng.standard_normal((12, 16))
    fig = viz.plot_embedding_shift(x, c, tokens)
    check_labels_clear(fig, np.concatenate(viz.pca_2d(x, c)))


def test_the_demo_picture_labels_every_token_once_and_clear():
    """qkv demo's own picture: "the" twice is told apart, and no label sits on another or on a marker."""
    from qkv import MultiHeadAttention, Vocabulary, sinusoidal_position_encoding, tokenize
    from qkv.cli import DEFAULT_TEXT
    from qkv.text import Embedding

    tokens = tokenize(DEFAULT_TEXT)
    rng = np.random.default_rng(0)  # as qkv demo draws: the table, then the layer
    emb = Embedding(len(Vocabulary.from_texts([DEFAULT_TEXT])), 32, rng=rng)
    x = (emb(Vocabulary.from_texts([DEFAULT_TEXT]).encode(tokens)) + sinusoidal_position_encoding(len(tokens), 32)).astype(np.float32)
    after = x + MultiHeadAttention(32, 4, rng=rng)(x)
    fig = viz.plot_embedding_shift(x, after, tokens)
    shown = check_labels_clear(fig, np.concatenate(viz.pca_2d(x, after)))
    red = [t for t in fig.axes[0].texts if t.get_color() == "#d62728"]
    assert len({t.get_text() for t in red}) == len(tokens)  # one distinct label per token
    assert {"the #0", "the #4"} <= set(shown)


def test_many_panels_keep_their_labels_out_of_each_other():
    """18 panels (one head in every layer): no panel's title, ticks or labels run into another panel's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    w = np.tril(np.full((18, 3, 3), 1 / 3))
    fig = viz.plot_attention(w, ["<bos>", "hello", " there"], mask=masks.causal(3), head_names=[f"layer {i} (window 512)" for i in range(18)], annotate=False)
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    panels = [ax for ax in fig.axes if ax.get_title()]

    def texts(ax):  # every piece of text a panel draws, and its frame
        parts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()]
        return [t.get_window_extent(renderer) for t in parts if t.get_text()] + [ax.get_window_extent(renderer)]

    boxes = [texts(ax) for ax in panels]
    overlaps = [(panels[i].get_title(), panels[j].get_title()) for i in range(len(panels)) for j in range(i + 1, len(panels)) if any(a.overlaps(b) for a in boxes[i] for b in boxes[j])]
    assert overlaps == []
    figure_texts = [t.get_window_extent(renderer) for t in (fig._supxlabel, fig._supylabel)] + [lg.get_window_extent(renderer) for lg in fig.legends]
    assert not any(a.overlaps(b) for i, a in enumerate(figure_texts) for b in figure_texts[i + 1 :])


def test_a_long_text_stays_a_readable_size_and_says_where_to_look(tmp_path):
    n = 501
    w = np.random.default_rng(0).dirichlet(np.ones(n), size=(4, n))
    fig = viz.plot_attention(w, [f"w{i}" for i in range(n)], scale="log", annotate=False)
    assert fig.get_size_inches()[0] <= viz.MAX_FIGURE_INCHES + 6  # the panels, plus labels and colour bar
    assert viz.labelled_every(n) == 13 and _tick_count(fig) <= viz.MAX_TICKS


def test_tokens_with_dollar_signs_are_drawn_as_written(tmp_path):
    """Tokens and titles come from texts and model files; matplotlib reads "$...$" as math, where a
    token "$\\frac$" had failed the drawing and "$x^2$" had been drawn as a formula."""
    from matplotlib.text import Text

    tokens = ["$\\frac$", "$$", "$x^2$", "cost", "$5"] * 8  # 40: tick labels beyond the first are made at draw time
    w = np.full((40, 40), 1 / 40)
    rng = np.random.default_rng(0)
    figs = [
        viz.plot_attention(w, tokens, title="$\\sqrt$ model", path=tmp_path / "a.png"),
        viz.plot_embedding_shift(rng.standard_normal((5, 8)), rng.standard_normal((5, 8)), tokens[:5], title="$\\frac$", path=tmp_path / "b.png"),
    ]
    for i, fig in enumerate(figs):
        fig.savefig(tmp_path / f"direct{i}.png")  # drawn outside qkv's save too, as a user may
        texts = [t for t in fig.findobj(Text) if "$" in t.get_text()]
        assert texts and not any(t.get_parse_math() for t in texts)
    assert [t.get_text() for t in figs[0].axes[0].get_xticklabels()][:3] == tokens[:3]
