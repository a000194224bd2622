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
    assert img.shape[:2] == (round(h_in * 120), round(w_in * 120))  # saved at 120 dpi
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
    glyph = [w for w in caught if "glyph" in str(w.message).lower()]
    assert len(glyph) <= 1  # one, saying what to install, where no installed font has them; none where one does


def test_pca_labels_do_not_overlap():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((12, 16))
    x[6] = x[0]  # the same word twice: one static point, two contextual ones
    tokens = ["i", "sat", "on", "the", "river", "bank", "bank", "cash", "at", "the", "money", "bank"]
    fig = viz.plot_embedding_shift(x, x + 0.05 * rng.standard_normal((12, 16)), tokens)
    renderer = fig.canvas.get_renderer() if hasattr(fig.canvas, "get_renderer") else None
    if renderer is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    boxes = [t.get_window_extent(renderer) for t in fig.axes[0].texts if t.get_text()]
    overlaps = sum(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    assert overlaps == 0
