"""qkv serve's parts without the HTTP server: pages, paged attention, row-invariant products, the engine step.

The server itself (the openai client against a real process) is tests/test_serve_http.py.
"""

import numpy as np
import pytest

from qkv.models.engines.text_stream import TextStream
from qkv.models.formats.quants import SUPPORTED
from qkv.models.serving.engine import Batch, forward_step, log_probabilities, paged_attention
from qkv.models.serving.pages import OutOfPages, PagePool
from qkv.models.serving.scheduler import Request, Scheduler
from test_quants import float32_bound, random_blocks


# ------------------------------------------------------------ pages


def test_pages_are_shared_by_reference_and_cached_after_release():
    pool = PagePool(num_layers=2, num_pages=4, page_size=2, num_kv_heads=1, head_dim=2)
    a, b = pool.allocate(), pool.allocate()
    pool.publish(a, [5, 6], parent=None)
    pool.publish(b, [7, 8], parent=a)
    got, covered = pool.lookup([5, 6, 7, 8, 9])
    assert got == [a, b] and covered == 4 and pool.refs[a] == 2
    assert pool.lookup([5, 6, 7, 8, 9], limit=3) == ([a], 2)  # whole pages within the limit only
    pool.release([a])
    assert pool.lookup([5, 7]) == ([], 0)  # another first page: nothing shared
    assert pool.lookup([9, 9, 7, 8]) == ([], 0)  # the same second page after another first: not the same prefix
    pool.release([a, b, a, b])
    assert pool.pages_in_use == 0 and pool.cached_pages == 2 and pool.available == 4
    with pytest.raises(ValueError, match="released twice"):
        pool.release([a])


def test_a_page_outside_the_pool_is_an_error_never_another_page():
    pool = PagePool(num_layers=1, num_pages=4, page_size=2, num_kv_heads=1, head_dim=2)
    held = [pool.allocate() for _ in range(4)]
    for bad in (-1, 4, 2.0):
        with pytest.raises((ValueError, TypeError), match="page"):
            pool.release([bad])  # -1 would have released the last page
        with pytest.raises((ValueError, TypeError), match="page"):
            pool.publish(bad, [1, 2], parent=None)
        with pytest.raises((ValueError, TypeError), match="parent"):
            pool.publish(held[0], [1, 2], parent=bad)
    assert pool.pages_in_use == 4 and pool.cached_pages == 0


def test_cached_pages_are_evicted_least_recently_used_first():
    pool = PagePool(num_layers=1, num_pages=3, page_size=1, num_kv_heads=1, head_dim=1)
    pages = [pool.allocate() for _ in range(3)]
    for p, tok in zip(pages, (1, 2, 3)):
        pool.publish(p, [tok], parent=None)
    pool.release([pages[1]])
    pool.release([pages[0]])  # used more recently than pages[1]
    assert pool.allocate() == pages[1]  # the least recently used goes first, and is forgotten
    assert pool.lookup([2]) == ([], 0)
    assert pool.lookup([1]) == ([pages[0]], 1)
    with pytest.raises(OutOfPages):
        pool.allocate()


def test_an_identical_page_published_twice_keeps_the_first():
    pool = PagePool(num_layers=1, num_pages=2, page_size=1, num_kv_heads=1, head_dim=1)
    a, b = pool.allocate(), pool.allocate()
    pool.publish(a, [4], parent=None)
    pool.publish(b, [4], parent=None)
    pool.release([b])  # not published: free again, not cached
    assert pool.cached_pages == 0 and pool.lookup([4]) == ([a], 1)


def test_text_stream_never_shows_what_a_stop_string_takes_back():
    class Chars:
        def decode(self, ids):
            return "".join(map(chr, ids))

    s = TextStream(Chars(), stop=["STOP"])
    shown = "".join(s.push(ord(c)) for c in "ab ST")
    assert "S" not in shown and "ab ST".startswith(shown)
    assert shown + s.finish("ab ") == "ab "
    s = TextStream(Chars(), stop=["xyz"])
    assert [s.push(ord(c)) for c in "ab"] == ["", ""]  # shorter than the stop string: nothing yet


def _shown_by_decoding_everything(tokenizer, ids, stop):
    """The oracle: the text of all the tokens at each push, shown as TextStream shows it."""
    hold, shown, out = max((len(x) for x in stop), default=0), "", []
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        ready = "" if text.endswith("\ufffd") else text[: max(0, len(text) - hold)]
        if len(ready) > len(shown) and ready.startswith(shown):
            out.append(ready[len(shown) :])
            shown = ready
        else:
            out.append("")
    return out


class _Counting:
    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids)


def test_text_stream_shows_what_decoding_every_token_shows_from_a_few_tokens_a_push(lm):
    """Gemma's SentencePiece tokenizer (byte fallback: characters split over tokens), a byte-level BPE,
    a SentencePiece-style one whose decoder drops the first word's space (as Llama's) and a WordPiece
    one (joins "##" pieces, tidies spaces before punctuation): the same pieces as decoding all the
    tokens at every push, for text and for random ids, with and without stop strings; a push decodes
    a few tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = "Attention, all the way down: naïve café — 注意力机制 🙂🚀 e^x/Σ e^x.\n\nNext line\tend. " * 4
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.pre_tokenizer, spm.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spm.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False))
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer, wordpiece.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    wordpiece.train_from_iterator([text], trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"], show_progress=False))
    rng = np.random.default_rng(5)
    own = [(t, lambda x, t=t: t.encode(x).ids, t.get_vocab_size()) for t in (bpe, spm, wordpiece)]
    for tokenizer, encode, vocab in [(lm.tokenizer, lm.tokenizer.encode, lm.tokenizer.vocab_size), *own]:
        for ids in (list(encode(text)), rng.integers(0, vocab, 300).tolist()):
            for stop in ((), ("\n\n", "注意")):
                s = TextStream(tokenizer, stop)
                assert [s.push(i) for i in ids] == _shown_by_decoding_everything(tokenizer, ids, stop)
    counting = _Counting(lm.tokenizer)
    s = TextStream(counting)
    ids = list(lm.tokenizer.encode(text * 10))
    shown = "".join(s.push(i) for i in ids)
    assert shown == s.text == lm.tokenizer.decode(ids) and counting.decoded <= 2 * (TextStream.WINDOW + 1) * len(ids)  # not len(ids) ** 2 / 2


# ------------------------------------------------------------ paged attention against torch


@pytest.mark.parametrize(
    "window,softcap,sinks,alibi,page",
    [(None, None, False, False, 4), (5, None, False, False, 4), (None, 30.0, True, False, 4), (3, None, False, True, 4), (None, None, False, False, 16), (21, None, False, False, 16)],
)
def test_paged_attention_equals_torch_over_gathered_keys(torch, window, softcap, sinks, alibi, page):
    rng = np.random.default_rng(0)
    Hq, Hk, D, P = 4, 2, 16, 12
    lengths = [7, 1, 11] if page == 4 else [37, 1, 22]  # each sequence's tokens; the last 3 of each are this step's queries
    kp = rng.standard_normal((P, page, Hk, D)).astype(np.float32)
    vp = rng.standard_normal((P, page, Hk, D)).astype(np.float32)
    order = rng.permutation(P)  # pages in any order
    table = np.zeros((3, 3), np.int64)
    used = 0
    for b, n in enumerate(lengths):
        k = -(-n // page)
        table[b, :k] = order[used : used + k]
        used += k
    rows, positions = [], []
    for b, n in enumerate(lengths):
        for p in range(max(0, n - 3), n):
            rows.append(b)
            positions.append(p)
    T = len(rows)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    sink = rng.standard_normal(Hq).astype(np.float32) if sinks else None
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32) if alibi else None
    scale = D**-0.5
    out = paged_attention(q, kp, vp, table, rows, positions, window=window, scale=scale, softcap=softcap, sinks=sink, alibi_slopes=slopes)
    assert out.dtype == np.float32 and out.shape == (T, Hq, D)
    F = torch.nn.functional
    for t in range(T):  # torch, float64, over the sequence's keys gathered by hand
        b, p = rows[t], positions[t]
        keys = np.concatenate([kp[table[b, j // page], j % page][None] for j in range(p + 1)])  # (S, Hk, D)
        vals = np.concatenate([vp[table[b, j // page], j % page][None] for j in range(p + 1)])
        kk = torch.tensor(np.repeat(keys, Hq // Hk, axis=1).transpose(1, 0, 2), dtype=torch.float64)  # (Hq, S, D)
        vv = torch.tensor(np.repeat(vals, Hq // Hk, axis=1).transpose(1, 0, 2), dtype=torch.float64)
        qq = torch.tensor(q[t][:, None, :], dtype=torch.float64)  # (Hq, 1, D)
        s = (qq @ kk.transpose(-1, -2)) * scale  # (Hq, 1, S)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        j = torch.arange(p + 1, dtype=torch.float64)
        if alibi:
            s = s - torch.tensor(slopes, dtype=torch.float64)[:, None, None] * (p - j)
        if window:
            s = s.masked_fill(j <= p - window, float("-inf"))
        if sinks:
            s = torch.cat([s, torch.tensor(sink, dtype=torch.float64)[:, None, None]], dim=-1)
        w = torch.softmax(s, dim=-1)[..., : p + 1]
        ref = (w @ vv)[:, 0].numpy()  # (Hq, D)
        np.testing.assert_allclose(out[t], ref, rtol=1e-5, atol=1e-5)


def test_paged_attention_gives_each_token_the_same_bits_alone_in_a_batch_and_on_any_threads():
    """A token's output is made from its own keys alone: the same bits in a batch of ragged sequences
    (pages in any order, a sliding window), alone, and on one thread or two."""
    from qkv import set_num_threads

    rng = np.random.default_rng(1)
    Hq, Hk, D, page = 8, 1, 32, 16
    lengths = [50, 3, 17, 33]
    P = sum(-(-n // page) for n in lengths)
    kp = rng.standard_normal((P, page, Hk, D)).astype(np.float32)
    vp = rng.standard_normal((P, page, Hk, D)).astype(np.float32)
    table = np.zeros((len(lengths), 4), np.int64)
    order, used = rng.permutation(P), 0
    for b, n in enumerate(lengths):
        table[b, : -(-n // page)] = order[used : used + -(-n // page)]
        used += -(-n // page)
    rows = np.arange(len(lengths))
    positions = np.array(lengths) - 1
    q = rng.standard_normal((len(lengths), Hq, D)).astype(np.float32)
    kw = dict(scale=D**-0.5, window=40)
    runs = []
    for threads in (1, 2):
        with set_num_threads(threads):
            batch = paged_attention(q, kp, vp, table, rows, positions, **kw)
            alone = [paged_attention(q[t : t + 1], kp, vp, table, rows[t : t + 1], positions[t : t + 1], **kw)[0] for t in range(len(lengths))]
        assert all(np.array_equal(batch[t], alone[t]) for t in range(len(lengths)))
        runs.append(batch)
    assert np.array_equal(runs[0], runs[1])
    # The kernel takes a key head's 8 query heads together, in as many parts as the threads want (a
    # token alone on 2 threads: 2 parts; several: 1): each part count, uneven ones too, gives the same bits.
    from qkv.models.serving import engine

    for parts in range(1, Hq // Hk + 1):
        out = np.empty_like(runs[0])
        engine._paged_attention(q, kp, vp, table, rows, positions, 40, np.float32(D**-0.5), np.float32(0), np.zeros(0, np.float32), np.zeros(Hq, np.float32), parts, out)
        assert np.array_equal(out, runs[0]), parts


PAGED_BAD = [  # (what is changed, value, what the error names); 2 sequences, 4 pages of 4 positions, one key head
    ("block_table", [[0, -1], [2, 3]], "block_table's pages"),  # -1 read by position 5: never wraps to the last page
    ("block_table", [[0, 9], [2, 3]], "block_table's pages"),  # past the pool: the kernel would read outside it
    ("block_table", [[0.0, 1.0], [2.0, 3.0]], "block_table"),
    ("rows", [0, 2], "rows"),
    ("rows", [0, -1], "rows"),
    ("positions", [5, -1], "positions"),
    ("positions", [5, 8], "positions"),
    ("positions", [5], "positions"),
    ("sinks", np.zeros(1, np.float32), "sinks"),
    ("key_pages", np.zeros((4, 4, 1, 8), np.float64), "key_pages"),
    ("value_pages", np.zeros((4, 4, 1, 4), np.float32), "value_pages"),
    ("query", np.zeros((2, 8), np.float32), "query shape"),
]


@pytest.mark.parametrize("name,value,named", PAGED_BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(PAGED_BAD)])
def test_paged_attention_checks_every_index_before_its_kernel_reads(name, value, named):
    # Its compiled kernel reads without bounds checks: a page, row or position out of range would read
    # other memory (a page 9 of 4 gave numbers like 1e28; a row past the table crashed the interpreter).
    rng = np.random.default_rng(0)
    args = dict(query=rng.standard_normal((2, 2, 8)).astype(np.float32), key_pages=rng.standard_normal((4, 4, 1, 8)).astype(np.float32),
                value_pages=rng.standard_normal((4, 4, 1, 8)).astype(np.float32), block_table=np.array([[0, 1], [2, 3]]), rows=np.array([0, 1]), positions=np.array([5, 7]))  # fmt: skip
    ok = paged_attention(**args, scale=0.5)
    assert np.isfinite(ok).all()
    args[name] = np.asarray(value)
    with pytest.raises((ValueError, TypeError), match=named):  # TypeError: a dtype
        paged_attention(**args, scale=0.5)


def test_paged_attention_reads_only_the_pages_a_token_needs():
    # as gather_pages: a table's unused tail (a page number not yet given, -1 say) is never read, so never checked
    rng = np.random.default_rng(0)
    q, kp, vp = rng.standard_normal((1, 2, 8)).astype(np.float32), rng.standard_normal((4, 4, 1, 8)).astype(np.float32), rng.standard_normal((4, 4, 1, 8)).astype(np.float32)
    got = paged_attention(q, kp, vp, np.array([[2, -1]]), [0], [3], scale=0.5)
    assert np.array_equal(got, paged_attention(q, kp, vp, np.array([[2, 0]]), [0], [3], scale=0.5))


def test_a_step_checks_its_tokens_pages_and_positions(lm):
    pool = PagePool(lm.config.num_layers, 4, 16, lm.config.num_kv_heads, lm.config.head_dim)
    ids = lm.tokenizer.encode("The capital of France is")
    for table, positions, tokens, named in (([[0, -1]], range(14, 14 + len(ids)), ids, "block_table's pages"), ([[0, 1]], range(len(ids)), [5, -3, *ids[2:]], "batch.tokens")):
        with pytest.raises(ValueError, match=named):
            forward_step(lm, pool, Batch(tokens, [0] * len(ids), list(positions), np.array(table), [len(ids) - 1], 16))
    with pytest.raises(ValueError, match="positions"):
        Batch(ids, [0] * len(ids), [-1, *range(1, len(ids))], np.array([[0, 1]]), [len(ids) - 1], 16)  # a negative position never wraps
    with pytest.raises(ValueError, match="rows"):
        Batch(ids, [1] * len(ids), range(len(ids)), np.array([[0, 1]]), [len(ids) - 1], 16)
    assert pool.pages_in_use == 0 and not pool.keys.any()  # refused before anything was written


# ------------------------------------------------------------ log-probabilities


def test_log_probabilities_equal_torch_in_float64_and_each_row_alone(torch):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((6, 50_000)) * 4).astype(np.float32)
    logits[1, [10, 20, 30]] = logits[1].max() + 1  # a three-way tie at the top: lower ids first
    logits[2, 5:40_000] = -np.inf  # masked-out tokens (probability 0)
    ks = [1, 0, 3, None, 20, 5]
    got = log_probabilities(logits, ks)
    gold = torch.logsumexp(torch.from_numpy(logits).double(), dim=1).numpy()
    for i, k in enumerate(ks):
        if k is None:
            assert got[i] == (None, None)
            continue
        log_z, top = got[i]
        assert isinstance(log_z, float) and abs(log_z - gold[i]) <= 1e-6 * abs(gold[i]), (i, log_z, gold[i])
        order = np.lexsort((np.arange(logits.shape[1]), -logits[i]))  # descending, ties by id
        assert top.tolist() == order[:k].tolist()
        alone = log_probabilities(logits[i : i + 1], [k])[0]  # the same numbers without the other rows
        assert alone[0] == log_z and alone[1].tolist() == top.tolist()
    assert got[1][1].tolist() == []


def test_log_probabilities_of_a_row_with_nan_or_infinity_are_numpys():
    rng = np.random.default_rng(8)
    rows = (rng.standard_normal((3, 1000))).astype(np.float32)
    rows[0, 3], rows[1, 4], rows[2, 9] = np.nan, np.inf, -np.inf
    got = log_probabilities(rows, [2, 2, 2])
    assert np.isnan(got[0][0]) and np.isnan(got[1][0])  # as max/exp/sum give them: no number made up
    assert got[1][1].tolist()[0] == 4  # +inf is the most likely token
    ref = float(np.log(np.exp(rows[2].astype(np.float64)).sum()))
    assert abs(got[2][0] - ref) <= 1e-6 * abs(ref)  # -inf is a token of probability 0, nothing worse


# ------------------------------------------------------------ row-invariant products


@pytest.mark.parametrize("qtype", ["F32", *SUPPORTED])
def test_row_invariant_products_give_each_token_the_same_bits_in_any_batch(qtype):
    from qkv.models.formats.quants import QuantizedMatrix, dequantize_rows, matmul, row_invariant

    rng = np.random.default_rng(1)
    if qtype == "F32":
        w = rng.standard_normal((70, 512)).astype(np.float32)
        ref_w = w.astype(np.float64)
    else:
        w = QuantizedMatrix(random_blocks(qtype, 70, 512, rng), qtype, (70, 512))
        ref_w = dequantize_rows(w.raw, qtype, 512).astype(np.float64)  # gguf's own decoder
    x = rng.standard_normal((45, 512)).astype(np.float32)
    with row_invariant():
        alone = np.concatenate([matmul(x[t : t + 1], w) for t in range(len(x))])
        for n in (2, 3, 5, 7, 33, 45):  # every size of the last group of 1-3 tokens; batches below, at and past the chunk of 32
            got = np.concatenate([matmul(x[t : t + n], w) for t in range(0, len(x), n)])
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, alone)
    ref = x.astype(np.float64) @ ref_w.T
    assert np.abs(alone - ref).max() <= float32_bound(x, ref_w, ref)
    outside = np.concatenate([matmul(x[t : t + 1], w) for t in range(len(x))])  # the default products: the same values to rounding
    assert np.abs(outside - ref).max() <= float32_bound(x, ref_w, ref)


# ------------------------------------------------------------ the engine step on the real model


@pytest.fixture(scope="module")
def lm():
    from qkv.models import load_causal_lm

    return load_causal_lm()


def _generate(lm, pool, prompts, chunk, steps, *, together=True, int8=False):
    """Greedy tokens and every step's logits of several prompts, run side by side through forward_step."""
    PS = pool.page_size
    seqs = [{"toks": list(p), "pages": [], "done": 0, "logits": []} for p in prompts]
    for _ in range(steps):
        groups = [seqs] if together else [[s] for s in seqs]
        for group in groups:
            while any(s["done"] < len(s["toks"]) for s in group):
                toks, rows, pos, want = [], [], [], []
                for b, s in enumerate(group):
                    n = min(chunk, len(s["toks"]) - s["done"])
                    while len(s["pages"]) * PS < s["done"] + n:
                        s["pages"].append(pool.allocate())
                    toks += s["toks"][s["done"] : s["done"] + n]
                    rows += [b] * n
                    pos += range(s["done"], s["done"] + n)
                    if n and s["done"] + n == len(s["toks"]):
                        want.append((b, len(toks) - 1))
                    s["done"] += n
                table = np.zeros((len(group), max(len(s["pages"]) for s in group)), np.int64)
                for b, s in enumerate(group):
                    table[b, : len(s["pages"])] = s["pages"]
                logits = forward_step(lm, pool, Batch(toks, rows, pos, table, [i for _, i in want], PS), int8_activations=int8)
                for (b, _), lg in zip(want, logits):
                    group[b]["logits"].append(lg.copy())
            for s in group:
                s["toks"].append(int(s["logits"][-1].argmax()))
    for s in seqs:
        pool.release(s["pages"])
    return seqs


def test_engine_logits_are_the_same_bits_alone_batched_and_in_any_chunk(lm):
    cfg = lm.config
    pool = PagePool(cfg.num_layers, 64, 8, cfg.num_kv_heads, cfg.head_dim)
    texts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a land far away, there lived"]
    prompts = [lm.tokenizer.encode(t) for t in texts]
    alone = _generate(lm, pool, prompts, chunk=64, steps=4, together=False)
    together = _generate(lm, pool, prompts, chunk=5, steps=4)  # other prompts beside it, prompts in chunks of 5
    for a, b in zip(alone, together):
        assert a["toks"] == b["toks"]
        for x, y in zip(a["logits"], b["logits"]):
            assert x.dtype == np.float32
            np.testing.assert_array_equal(x, y)
    ref = lm.generate(prompts[0], max_new_tokens=4)  # and the model's own generate, token for token
    assert alone[0]["toks"][len(prompts[0]) :] == ref.token_ids


def test_int8_activations_keep_each_answer_the_same_alone_batched_and_in_any_chunk(lm):
    from qkv.models.formats.quants import int8_activations

    cfg = lm.config
    pool = PagePool(cfg.num_layers, 64, 8, cfg.num_kv_heads, cfg.head_dim)
    prompts = [lm.tokenizer.encode(t) for t in ["The capital of France is", "Once upon a time, in a land far away, there lived"]]
    alone = _generate(lm, pool, prompts, chunk=64, steps=3, together=False, int8=True)
    together = _generate(lm, pool, prompts, chunk=5, steps=3, int8=True)
    for a, b in zip(alone, together):
        assert a["toks"] == b["toks"]
        for x, y in zip(a["logits"], b["logits"]):
            np.testing.assert_array_equal(x, y)
    exact = _generate(lm, pool, prompts[:1], chunk=64, steps=1, together=False)
    moved = np.abs(alone[0]["logits"][0] - exact[0]["logits"][0]).max()
    assert 0 < moved < 0.1 * np.abs(exact[0]["logits"][0]).max()  # int8 products really ran, and stayed close
    with int8_activations():
        ref = lm.generate(prompts[0], max_new_tokens=3)  # what qkv generate --int8-activations gives
    assert alone[0]["toks"][len(prompts[0]) :] == ref.token_ids
    assert pool.pages_in_use == 0


def test_scheduler_preempts_and_recomputes_without_changing_an_answer(lm):
    """A pool too small for two requests at once: one is preempted, recomputed later, same tokens."""
    got = {}

    def runner(name):
        events = []

        def emit(kind, payload):
            events.append((kind, payload))

        got[name] = events
        return emit

    prompt = lm.tokenizer.encode("Counting: one, two, three,")

    def run(pages, names):
        s = Scheduler(lm, num_pages=pages, page_size=4, max_batch=4, prefill_chunk=64)
        for n in names:
            s.submit(Request(prompt=prompt, max_tokens=12, emit=runner(n), top_logprobs=0))
        while s.running or s.waiting:
            s.step()
        return s

    run(64, ["alone"])
    s = run(9, ["a", "b"])  # 9 pages of 4: each request grows to 5, so both cannot finish side by side
    assert s.preempted > 0 and s.pool.pages_in_use == 0
    toks = [[p["token"] for k, p in got[n] if k == "token" and p.get("token") is not None] for n in ("alone", "a", "b")]
    lps = [[p["logprob"] for k, p in got[n] if k == "token" and p.get("token") is not None] for n in ("alone", "a", "b")]
    assert toks[0] == toks[1] == toks[2] and len(toks[0]) == 12
    assert lps[0] == lps[1] == lps[2]


def test_warm_up_leaves_nothing_behind_and_changes_no_answer(lm):
    """The server's warm-up (compiled code loaded, threads started before the first request) uses pages
    of its own: no page taken or cached, nothing counted, and a request's tokens and log-probabilities
    are those of a scheduler that never warmed up."""
    answers = []
    for warm in (True, False):
        events = []
        s = Scheduler(lm, num_pages=16, page_size=4)
        if warm:
            s.warm_up()
            assert s.pool.pages_in_use == 0 and s.pool.cached_pages == 0 and s.pool.available == 16
            assert s.generated_tokens == s.prompt_tokens == 0 and not s.ttft and not s._recent
        s.submit(Request(prompt=lm.tokenizer.encode("The warm-up"), max_tokens=6, emit=lambda k, p: events.append((k, p)), top_logprobs=1))
        while s.running or s.waiting:
            s.step()
        answers.append([(p["token"], p["logprob"]) for k, p in events if k == "token" and p.get("token") is not None])
    assert answers[0] == answers[1] and len(answers[0]) == 6


def test_a_closed_scheduler_refuses_a_request_rather_than_keep_it_for_ever(lm):
    from qkv.models.serving.scheduler import Closed

    s = Scheduler(lm, num_pages=16, page_size=4)
    s.start(warm_up=False)
    events = []
    s.close()
    with pytest.raises(Closed, match="shutting down"):
        s.submit(Request(prompt=[2, 3], max_tokens=2, emit=lambda k, p: events.append(k)))
    assert not s.waiting and not events


def test_an_engine_failure_answers_every_request_with_an_error_and_the_server_goes_on(lm, monkeypatch):
    """A step that raises (a bug) ends the requests it had with a 500 in OpenAI's shape, streamed or not;
    their pages go back, and the next request is served. (The events of a step reach the HTTP side
    together, after the step: this is the path that must still deliver them.)"""
    import http.client
    import json

    from qkv.models.serving import scheduler as sched
    from qkv.models.serving.server import start_server

    def post(port, body):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()

    real = sched.forward_step
    with start_server(lm, model_name="m", kv_tokens=512) as srv:

        def broken(*args, **kw):
            raise RuntimeError("a bug in a step")

        monkeypatch.setattr(sched, "forward_step", broken)
        status, text = post(srv.port, {"prompt": "Hello", "max_tokens": 4})
        assert status == 500 and json.loads(text)["error"]["type"] == "server_error" and json.loads(text)["error"]["code"] == "internal_error"
        status, text = post(srv.port, {"prompt": "Hello", "max_tokens": 4, "stream": True})
        assert status == 200  # the stream had begun: the error is its last event
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert events and events[-1]["error"]["type"] == "server_error"
        assert srv.scheduler.pool.pages_in_use == 0
        monkeypatch.setattr(sched, "forward_step", real)
        status, text = post(srv.port, {"prompt": "Hello", "max_tokens": 4})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4


def test_a_schema_that_fails_mid_answer_ends_its_request_alone_with_a_400(lm, monkeypatch):
    """llguidance's matcher can stop on one of its limits mid-answer: that request ends with a 400 in
    OpenAI's shape, its pages go back, and the requests beside it in the batch answer as alone."""
    import http.client
    import json

    from qkv.models.engines import structured
    from qkv.models.serving.server import start_server

    def post(port, body):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read().decode())
        finally:
            c.close()

    real = structured.Matcher.mask
    calls = {"n": 0}

    def failing(self, logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("the JSON schema's matcher failed: a limit")
        return real(self, logits)

    monkeypatch.setattr(structured.Matcher, "mask", failing)
    with start_server(lm, model_name="m", kv_tokens=1024) as srv:
        alone = post(srv.port, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})[1]["choices"][0]["text"]
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            plain = pool.submit(post, srv.port, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
            schema = pool.submit(post, srv.port, {"prompt": "A cat as JSON:", "max_tokens": 8, "temperature": 0, "response_format": {"type": "json_object"}})
            (status, data), (plain_status, plain_data) = schema.result(), plain.result()
        assert status == 400 and data["error"]["type"] == "invalid_request_error" and "matcher failed" in data["error"]["message"]
        assert plain_status == 200 and plain_data["choices"][0]["text"] == alone
        assert srv.scheduler.pool.pages_in_use == 0


def test_greedy_tokens_are_numpys_argmax_whatever_log_probabilities_are_asked_for(lm):
    """A greedy request asking for log-probabilities takes its token from their search for the maximum;
    one asking for none takes np.argmax of the logits: the same tokens, and the log-probabilities asked
    for are the same numbers with or without alternatives."""
    got = {}
    for top in (None, 0, 1, 3):
        events = []
        s = Scheduler(lm, num_pages=32, page_size=4)
        for text in ("The capital of France is", "1, 2, 3,"):
            s.submit(Request(prompt=lm.tokenizer.encode(text), max_tokens=8, emit=lambda k, p, text=text: events.append((text, k, p)), top_logprobs=top))
        while s.running or s.waiting:
            s.step()
        got[top] = [(t, p["token"], p.get("logprob")) for t, k, p in events if k == "token" and p.get("token") is not None]
        assert all(len(p.get("top", [])) == (top or 0) for _, k, p in events if k == "token" and p.get("token") is not None)
    tokens = {top: [(t, tok) for t, tok, _ in v] for top, v in got.items()}
    assert tokens[0] == tokens[1] == tokens[3] == tokens[None] and len(tokens[None]) == 16
    assert got[0] == got[1] == got[3]


def test_a_request_that_sets_no_sampling_gets_the_models_recommendation(torch, tmp_path):
    """qkv serve's defaults for temperature, top_p, top_k, min_p and repetition_penalty are what the model's
    files recommend (as vLLM and llama-server take them), OpenAI's for the rest; what a request sets wins;
    sampling_defaults={} (qkv serve --sampling-defaults openai) gives OpenAI's whatever the model says."""
    import http.client
    import json

    from qkv.models import load_causal_lm
    from qkv.models.serving.server import start_server
    from test_decoder import _tiny

    model, d = _tiny("llama", torch, tmp_path)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_k": 3, "repetition_penalty": 1.4}))
    lm = load_causal_lm(d)
    prompt = "w5 w9 w17 w33"

    def post(port, body):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            c.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 12, "seed": 5, **body}), {"Content-Type": "application/json"})
            r = c.getresponse()
            assert r.status == 200
            return json.loads(r.read())["choices"][0]["text"]
        finally:
            c.close()

    def text(**options):
        return lm.generate(prompt, max_new_tokens=12, seed=5, stop_at_eos=True, **options).text

    recommended = text(temperature=0.6, top_k=3, repetition_penalty=1.4)
    with start_server(lm, model_name="m", kv_tokens=512) as srv:
        assert post(srv.port, {}) == recommended
        assert post(srv.port, {"temperature": None, "top_k": None}) == recommended  # null: the default
        assert post(srv.port, {"temperature": 0}) == text(temperature=0, repetition_penalty=1.4)  # a request's own setting wins
        assert post(srv.port, {"top_k": 50, "repetition_penalty": 1}) == text(temperature=0.6, top_k=50)
    with start_server(lm, model_name="m", kv_tokens=512, sampling_defaults={}) as srv:
        assert post(srv.port, {}) == text(temperature=1.0)
    assert len({recommended, text(temperature=1.0), text(temperature=0, repetition_penalty=1.4)}) == 3  # the comparisons tell the settings apart
    for bad, match in (({"temperature": -1.0}, "temperature should be a finite number >= 0"), ({"top_k": 0}, "top_k should be an integer >= 1"), ({"seed": 3}, "should set only")):
        with pytest.raises(ValueError, match=match):
            start_server(lm, model_name="m", kv_tokens=512, sampling_defaults=bad)
