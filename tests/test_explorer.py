"""The attention explorer: the page qkv.explorer writes, driven in a real browser.

The browser is Debian's Chromium driven by Playwright (its own browser download cannot work here).
`.ci/run` installs both, so in CI these tests run; elsewhere they are skipped only when no Chromium
is installed.
"""

import base64
import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from qkv import explorer, masks, softmax

IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"


def _random_weights(rng, shape, mask=None, sharp=2.0):
    return softmax(rng.normal(size=shape) * sharp, where=mask)


def _page_data(page_html: str) -> dict:
    blob = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page_html, re.S).group(1)
    return json.loads(blob)


def _decode(data: dict) -> np.ndarray:
    """The weights as the page stores them, NaN where masked: the same decoding the script does."""
    codes = np.frombuffer(zlib.decompress(base64.b64decode(data["codes"])), dtype="<u2").reshape(data["shape"])
    return np.where(codes == data["maskedCode"], np.nan, codes / data["scaleCode"])


# ------------------------------------------------------------ without a browser
def test_page_holds_the_weights_and_the_mask():
    rng = np.random.default_rng(1)
    L = 9
    w = _random_weights(rng, (3, 2, L, L), masks.causal(L))  # (N, H, L, S)
    page = explorer.render_html(w, [f"w{i}" for i in range(L)], mask=masks.causal(L))
    got = _decode(_page_data(page))
    keep = np.broadcast_to(masks.causal(L), w.shape)
    assert np.array_equal(np.isnan(got), ~keep)
    assert np.abs(got[keep] - w[keep]).max() <= 0.5 / explorer.SCALE_CODE + 1e-12


def test_accepted_inputs_are_stacked_to_layers_and_heads():
    rng = np.random.default_rng(2)
    w = _random_weights(rng, (2, 4, 5))  # (H, L, S)
    tokens, keys = list("abcd"), list("vwxyz")
    for given, shape in ((w[0], [1, 1, 4, 5]), (w, [1, 2, 4, 5]), ([w, w, w], [3, 2, 4, 5]), (w[None], [1, 2, 4, 5])):
        data = _page_data(explorer.render_html(given, tokens, key_tokens=keys))
        assert data["shape"] == shape and data["keyTokens"] == keys
    from qkv import MultiHeadAttention

    x = rng.normal(size=(6, 8)).astype(np.float32)
    _, trace = MultiHeadAttention(8, 2, rng=0)(x, is_causal=True, return_trace=True)
    data = _page_data(explorer.render_html(trace, list("abcdef"), mask=trace.mask))
    assert data["shape"] == [1, 2, 6, 6]
    np.testing.assert_allclose(np.nan_to_num(_decode(data)[0]), trace.weights, atol=1e-5)


def test_tokens_cannot_close_the_data_script():
    page = explorer.render_html(np.full((2, 2), 0.5), ["</script><script>alert(1)</script>", "{{DATA}}"], title="<b>{{SCRIPT}}</b>")
    assert page.count("</script>") == 2  # the data's and the script's own
    data = _page_data(page)
    assert data["queryTokens"][0].startswith("</script>") and data["queryTokens"][1] == "{{DATA}}"
    assert "<title>&lt;b&gt;{{SCRIPT}}&lt;/b&gt;</title>" in page


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda w: explorer.render_html(w, ["a", "b"]), ValueError, "tokens should have 3 entries to match the weights, got 2"),
        (lambda w: explorer.render_html(np.where(np.eye(3, dtype=bool), np.nan, w), list("abc")), ValueError, "weights should be finite, got nan at (layer, head, query, key) = (0, 0, 0, 0)"),
        (lambda w: explorer.render_html(w * 3, list("abc")), ValueError, "weights should be attention probabilities in [0, 1]"),
        (lambda w: explorer.render_html(w[:2], list("ab")), ValueError, "give key_tokens (length 3)"),
        (lambda w: explorer.render_html(w, list("abc"), mask=masks.causal(3)), ValueError, "weights are non-zero (up to"),
        (lambda w: explorer.render_html(w, list("abc"), mask=np.ones((2, 2), bool)), ValueError, "mask shape should broadcast to the weights' (N, H, L, S) = (1, 1, 3, 3), got (2, 2)"),
        (lambda w: explorer.render_html(w, list("abc"), mask=np.ones((3, 3))), TypeError, "mask should be a boolean array"),
        (lambda w: explorer.render_html(w, "abc"), TypeError, "tokens should be a sequence of token strings, got a str"),
        (lambda w: explorer.render_html(w, list("abc"), head_names=["x", "y"]), ValueError, "head_names should have 1 entries"),
        (lambda w: explorer.render_html(w, list("abc"), layer=1), ValueError, "layer should be in [0, 0], got 1"),
        (lambda w: explorer.render_html(w, list("abc"), scale="sqrt"), ValueError, "scale should be 'linear' or 'log'"),
        (lambda w: explorer.render_html(np.ones((2, 2, 2, 2, 2)), list("ab")), ValueError, "weights shape should be (L, S), (H, L, S) or (N, H, L, S)"),
        (lambda w: explorer.render_html([w, w[:, :2]], list("abc")), ValueError, "every layer should have the same (H, L, S) shape"),
    ],
)
def test_bad_input_is_a_clear_error(call, error, message):
    w = _random_weights(np.random.default_rng(3), (3, 3))
    with pytest.raises(error) as info:
        call(w)
    assert message in str(info.value)


def test_bad_input_writes_no_file(tmp_path):
    out = tmp_path / "a.html"
    with pytest.raises(ValueError):
        explorer.write_html(out, np.full((2, 2), np.nan), ["a", "b"])
    with pytest.raises(OSError, match="does not exist"):
        explorer.write_html(tmp_path / "missing" / "a.html", np.full((2, 2), 0.5), ["a", "b"])
    with pytest.raises(ValueError, match="should end in .html"):
        explorer.write_html(tmp_path / "a.png", np.full((2, 2), 0.5), ["a", "b"])
    assert list(tmp_path.iterdir()) == []


def test_unwritable_place_is_an_oserror_naming_the_file(tmp_path):
    # /proc takes no new files, even from root (CI runs as root, which writes into read-only folders).
    target = Path("/proc/qkv-explorer-test.html")
    with pytest.raises(OSError, match=re.escape(f"cannot write '{target}'")):
        explorer.write_html(target, np.full((2, 2), 0.5), ["a", "b"])
    r = _qkv("demo", "a b", "--no-plots", "--html", str(target), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == f"qkv: error: cannot write '{target}': No such file or directory\n"


# --------------------------------------------------------------- in a browser (conftest.browser)
class Page:
    """One explorer page open in the browser, with what it logged and asked the network for."""

    def __init__(self, browser, path: Path, width: int = 1280):
        self.page = browser.new_page(viewport={"width": width, "height": 900})
        self.console, self.requests = [], []
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.console.append(f"error: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)
        self.page.wait_for_selector("body[data-ready='true']", timeout=10_000)

    def lines(self) -> list[tuple[int, int, int]]:
        """(head, query, key) of every line the head view has drawn."""
        return [tuple(x) for x in self.page.evaluate("() => window.qkvExplorer.drawnLines()")]

    def tooltip(self, i: int, j: int, scroll: bool = True) -> str:
        """Point at cell (query i, key j) of the matrix view (scrolled into view) and read the tooltip."""
        where = """([i, j]) => { const r = document.getElementById('matrix-canvas').getBoundingClientRect();
                     const e = window.qkvExplorer, s = e.state.cell;
                     return [r.left + e.matrix.left + (j + 0.5) * s, r.top + e.matrix.top + (i + 0.5) * s]; }"""
        if scroll:
            self.page.locator("#matrix-box").evaluate("b => b.scrollTo(0, 0)")
            x, y = self.page.evaluate(where, [i, j])
            box = self.page.locator("#matrix-box").bounding_box()
            self.page.locator("#matrix-box").evaluate("(b, at) => b.scrollTo(at[0], at[1])", [max(0, x - box["x"] - 300), max(0, y - box["y"] - 200)])
        x, y = self.page.evaluate(where, [i, j])
        self.page.mouse.move(x, y)
        return self.page.locator("#tooltip").inner_text()

    def assert_clean(self):
        assert self.console == [], self.console
        assert self.requests == [self.url], self.requests  # the page itself, nothing else


def _expected_lines(w, keep, layer, heads, threshold):
    """(head, query, key) of every line the head view should draw."""
    return sorted((h, i, j) for h in heads for i, j in zip(*np.nonzero((w[layer, h] >= threshold) & keep[layer, h] & (w[layer, h] > 0))))


def _parse_tooltip(text: str):
    m = re.search(r"query (\d+) .* -> key (\d+) .*: (?:weight ([0-9.]+)|(masked))", text, re.S)
    return int(m.group(1)), int(m.group(2)), None if m.group(4) else float(m.group(3))


@pytest.fixture(scope="module")
def model_page(browser, tmp_path_factory):
    """A 3-layer, 4-head page over 10 tokens, causal in layer 0 and a window of 3 in the others."""
    rng = np.random.default_rng(7)
    N, H, L = 3, 4, 10
    keep = np.stack([masks.causal(L)] + [masks.sliding_window(L, L, left=2, right=0)] * (N - 1))[:, None]  # (N, 1, L, L)
    w = np.stack([_random_weights(rng, (H, L, L), keep[n, 0]) for n in range(N)])  # (N, H, L, L)
    tokens = [f"tok{i}" for i in range(L)]
    path = tmp_path_factory.mktemp("page") / "model.html"
    explorer.write_html(path, w, tokens, mask=keep, layer=0)
    page = Page(browser, path)
    yield page, w, np.broadcast_to(keep, w.shape)
    page.page.close()


def test_page_loads_offline_with_no_errors_and_no_requests(model_page):
    page, w, keep = model_page
    page.assert_clean()
    assert page.page.title() == "qkv attention explorer"
    got = page.page.evaluate("() => { const e = window.qkvExplorer; return [e.meta.shape, e.weight(0, 1, 5, 2), e.weight(0, 1, 2, 5)]; }")
    assert got[0] == list(w.shape) and abs(got[1] - w[0, 1, 5, 2]) < 1e-5 and got[2] is None  # (2, 5) is above the diagonal


def test_head_view_draws_one_line_per_weight_above_the_threshold(model_page):
    page, w, keep = model_page
    p = page.page
    assert sorted(page.lines()) == _expected_lines(w, keep, 0, range(4), 0.01)
    p.select_option("#layer", "2")
    assert sorted(page.lines()) == _expected_lines(w, keep, 2, range(4), 0.01)
    for i, j in zip(*np.nonzero(~keep[2, 0])):  # no line where the window hides the key
        assert all((q, k) != (i, j) for _, q, k in page.lines())
    p.fill("#threshold", "0.2")
    p.press("#threshold", "Enter")
    assert sorted(page.lines()) == _expected_lines(w, keep, 2, range(4), 0.2)
    p.fill("#threshold", "0.01")
    p.press("#threshold", "Enter")
    p.select_option("#layer", "0")


def test_hovering_a_token_isolates_its_lines(model_page):
    page, w, keep = model_page
    p = page.page
    p.hover(".col .tok[data-side='query'][data-index='6']")
    shown = page.lines()
    assert shown and all(q == 6 for _, q, _ in shown)
    assert sorted(shown) == [t for t in _expected_lines(w, keep, 0, range(4), 0.01) if t[1] == 6]
    struck = p.eval_on_selector_all(".col .tok.masked", "els => els.map(e => +e.dataset.index)")
    assert struck == [7, 8, 9]  # the causal mask hides the later keys from query 6
    p.hover(".col .tok[data-side='key'][data-index='2']")
    shown = page.lines()
    assert shown and all(k == 2 for _, _, k in shown)
    p.mouse.move(1200, 850)  # off every token: all lines again
    assert sorted(page.lines()) == _expected_lines(w, keep, 0, range(4), 0.01)


def test_selecting_heads_changes_what_is_drawn(model_page):
    page, w, keep = model_page
    p = page.page
    p.click("#head-1")  # hide head 1
    assert sorted(page.lines()) == _expected_lines(w, keep, 0, [0, 2, 3], 0.01)
    p.click("#head-3", modifiers=["Shift"])  # head 3 alone
    assert sorted(page.lines()) == _expected_lines(w, keep, 0, [3], 0.01)
    for h in (0, 1, 2):
        p.click(f"#head-{h}")
    assert sorted(page.lines()) == _expected_lines(w, keep, 0, range(4), 0.01)


def test_model_view_has_a_heatmap_per_layer_and_head_and_opens_one(model_page):
    page, w, keep = model_page
    p = page.page
    p.click("button[data-view='model']")
    assert p.locator("canvas.thumb").count() == 3 * 4
    p.click("canvas.thumb[data-layer='1'][data-head='2']")
    assert p.locator("#view-matrix").is_visible() and p.input_value("#layer") == "1" and p.input_value("#matrix-head") == "2"
    for i, j in [(0, 0), (4, 3), (4, 1), (9, 9), (9, 0)]:
        qi, kj, shown = _parse_tooltip(page.tooltip(i, j))
        assert (qi, kj) == (i, j)
        if keep[1, 2, i, j]:
            assert shown == pytest.approx(w[1, 2, i, j], abs=5e-4)
        else:
            assert shown is None
    p.click("button[data-view='head']")
    page.assert_clean()


def test_matrix_view_stays_readable_for_hundreds_of_tokens(browser, tmp_path):
    rng = np.random.default_rng(11)
    L = 400
    w = _random_weights(rng, (2, 2, L, L), masks.causal(L), sharp=1.0)  # (N, H, L, S): 2 x 80,200 pairs, nearly all > 0
    path = explorer.write_html(tmp_path / "long.html", w, [f"t{i}" for i in range(L)], mask=masks.causal(L), head=1)
    page = Page(browser, path)
    p = page.page
    p.click("button[data-view='matrix']")
    cell = p.evaluate("() => window.qkvExplorer.state.cell")
    assert cell >= 2 and p.locator("#matrix-canvas").bounding_box()["width"] >= L * cell
    cases = [(int(i), int(j)) for i, j in rng.integers(0, L, size=(6, 2))] + [(399, 0), (200, 200)]
    for i, j in cases:
        assert _parse_tooltip(page.tooltip(i, j)) == (i, j, pytest.approx(w[1, 1, i, j], abs=5e-4) if j <= i else None)
    p.click("#zoom-in")
    p.click("#zoom-in")
    assert p.evaluate("() => window.qkvExplorer.state.cell") == 4 * cell
    qi, kj, shown = _parse_tooltip(page.tooltip(350, 120))  # scrolled into view, still exact
    assert (qi, kj) == (350, 120) and shown == pytest.approx(w[1, 1, 350, 120], abs=5e-4)
    # The head view refuses to draw an unreadable tangle instead of freezing the page.
    p.click("button[data-view='head']")
    p.click("#head-0")  # both heads
    p.fill("#threshold", "0")
    p.press("#threshold", "Enter")
    assert "more than" in p.inner_text("#head-message") and page.lines() == []
    page.assert_clean()


# ------------------------------------------------------------------- the CLI
def _qkv(*args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_demo_html_shows_the_demo_weights(browser, tmp_path):
    r = _qkv("demo", "--causal", "--format", "json", "--no-plots", "--html", "demo.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["files"] == ["demo.html"]
    weights = np.array(result["weights"])  # (H, L, L)
    page = Page(browser, tmp_path / "demo.html")
    L = len(result["tokens"])
    assert page.page.evaluate("() => window.qkvExplorer.meta.queryTokens") == result["tokens"]
    assert sorted(page.lines()) == _expected_lines(weights[None], np.broadcast_to(masks.causal(L), weights[None].shape), 0, range(4), 0.01)
    if os.environ.get("QKV_UPDATE_SCREENSHOTS"):
        page.page.hover(".col .tok[data-side='query'][data-index='8']")
        page.page.screenshot(path=str(IMAGES / "explorer_head_view.png"))
    page.assert_clean()


def test_attention_html_of_the_encoder_matches_its_weights(browser, tmp_path):
    from qkv.models import load_model

    text = "The animal didn't cross the street because it was too tired."
    r = _qkv("attention", text, "--html", "minilm.html", "--layer", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("wrote minilm.html") and not list(tmp_path.glob("**/*.png"))  # --html alone: no PNG
    res = load_model().encode_batch([text], output_attentions=True)
    att = np.stack([a[0] for a in res.attentions])  # (layers, H, L, L)
    page = Page(browser, tmp_path / "minilm.html")
    p = page.page
    assert p.input_value("#layer") == "2"
    p.click("button[data-view='model']")
    assert p.locator("canvas.thumb").count() == att.shape[0] * att.shape[1]
    if os.environ.get("QKV_UPDATE_SCREENSHOTS"):
        p.screenshot(path=str(IMAGES / "explorer_model_view.png"))
    p.click("canvas.thumb[data-layer='4'][data-head='7']")
    for i, j in [(0, 0), (3, 5), (10, 2), (15, 15)]:
        assert _parse_tooltip(page.tooltip(i, j)) == (i, j, pytest.approx(att[4, 7, i, j], abs=5e-4))
    page.assert_clean()


def test_attention_html_of_a_decoder_shows_its_windows(browser, tmp_path):
    from qkv.models import load_causal_lm

    lm = load_causal_lm()
    words = " ".join(["The river bank was steep and the water ran fast past the old mill."] * 36)
    r = _qkv("attention", words, "--model", "gemma3-270m", "--html", "gemma.html", "--head", "0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ids = lm.tokenizer.encode(words)
    res = lm.forward(ids, output_attentions=True, logits_to_keep=1)
    page = Page(browser, tmp_path / "gemma.html")
    p = page.page
    L = len(ids)
    assert L > 512 and p.evaluate("() => window.qkvExplorer.meta.shape") == [lm.config.num_layers, lm.config.num_heads, L, L]
    p.click("button[data-view='matrix']")
    sliding = lm.config.windows.index(512)  # a layer with the 512-token window
    p.select_option("#layer", str(sliding))
    for i, j in [(L - 1, 0), (L - 1, L - 513), (L - 1, L - 512), (L - 1, L - 300), (520, 8), (520, 9)]:
        visible = 0 <= i - j < 512
        assert _parse_tooltip(page.tooltip(i, j)) == (i, j, pytest.approx(float(res.attentions[sliding][0, 0, i, j]), abs=5e-4) if visible else None)
    if os.environ.get("QKV_UPDATE_SCREENSHOTS"):
        p.click("#zoom-out")  # every token in view: the window's edge is the lower-left triangle
        p.locator("#matrix-box").evaluate("b => b.scrollTo(0, 0)")
        page.tooltip(L - 20, 200, scroll=False)
        p.screenshot(path=str(IMAGES / "explorer_matrix_view.png"))
    page.assert_clean()


def test_three_kinds_side_by_side_load_in_the_browser(browser, tmp_path):
    """qkv train translate's heads.html: the encoder's, the decoder's and the cross-attention's explorers on
    one page, each drawn from its own data, with nothing logged and nothing fetched."""
    r = subprocess.run([sys.executable, "-m", "qkv", "train", "translate", "--steps", "20", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert r.returncode == 0, r.stderr
    page = browser.new_page(viewport={"width": 1800, "height": 1000})
    console, requests = [], []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"error: {e}"))
    page.on("request", lambda q: requests.append(q.url))
    page.goto((tmp_path / "heads.html").resolve().as_uri())
    frames = [f for f in page.frames if f != page.main_frame]
    assert len(frames) == 3
    shapes = []
    for f in frames:
        f.wait_for_selector("body[data-ready='true']", timeout=10_000)
        shapes.append(f.evaluate("() => JSON.parse(document.getElementById('qkv-data').textContent).shape"))
    assert shapes == [[2, 4, 10, 10]] * 3  # (layers, heads, queries, keys) of each kind
    assert console == [] and all(u.startswith(("file:", "about:")) for u in requests), (console, requests)
    page.close()
