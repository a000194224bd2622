"""GGUF weights kept quantized: the decoders against gguf.quants.dequantize (bit for bit), the products
against dequantize-then-float32 (to rounding), on random blocks with extreme scales, both kernels."""

import numpy as np
import pytest

from qkv.models.formats.quants import BLOCKS, SUPPORTED, QuantizedMatrix, StackedMatrix, dequantize_rows, stack

KERNELS = ["numpy", "numba"]


def random_blocks(qtype, rows, cols, rng, *, extreme=False):
    """Random valid blocks: random bits for the values, chosen float16 scales (extreme: the largest
    normal float16, subnormals, zeros and negative scales among them)."""
    per, size = BLOCKS[qtype]
    if qtype in ("F16", "BF16"):
        vals = rng.standard_normal((rows, cols)).astype(np.float32) * (1e4 if extreme else 1)
        if qtype == "F16":
            return vals.astype(np.float16).view(np.uint8)
        return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = cols // per
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    scales = rng.standard_normal((rows, nb, 2)).astype(np.float32) * 0.1
    if extreme:
        picks = np.array([65504.0, -65504.0, 6.0e-8, -6.0e-8, 0.0, 1e-5, 3.0], np.float32)
        scales = picks[rng.integers(0, len(picks), size=(rows, nb, 2))]
    s16 = scales.astype(np.float16).view(np.uint8).reshape(rows, nb, 2, 2)
    if qtype == "Q6_K":
        raw[:, :, 208:210] = s16[:, :, 0]
    else:
        raw[:, :, 0:2] = s16[:, :, 0]
        if qtype in ("Q4_K", "Q5_K"):
            raw[:, :, 2:4] = s16[:, :, 1]
    return raw.reshape(rows, nb * size)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", SUPPORTED)
@pytest.mark.parametrize("extreme", [False, True])
def test_decoding_is_gguf_dequantize_bit_for_bit(qtype, kernel, extreme):
    rng = np.random.default_rng(len(qtype) + extreme)
    cols = 512
    m = QuantizedMatrix(random_blocks(qtype, 24, cols, rng, extreme=extreme), qtype, (24, cols))
    want = dequantize_rows(m.raw, qtype, cols)  # gguf.quants.dequantize (F16: NumPy's view)
    got = m.dequantize(kernel=kernel)
    assert got.dtype == np.float32 and got.shape == (24, cols)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # the same bits
    rows = np.array([5, 0, 23, 5])
    np.testing.assert_array_equal(m.take(rows.reshape(2, 2)), want[rows].reshape(2, 2, cols))
    for one in (np.int64(23), np.array([0]), np.array([[7]], np.uint32), 23):  # one id (a decode step's): its own route
        got = m.take(one)
        assert got.shape == (*np.shape(one), cols) and got.dtype == np.float32
        np.testing.assert_array_equal(got.reshape(cols).view(np.uint32), want[int(np.ravel(one)[0])].view(np.uint32))
    for bad in (-1, 24, np.array([-1]), np.array([3, -2]), np.array([[0], [24]])):  # never wraps, never reads past the end
        with pytest.raises(ValueError, match=r"ids should lie in \[0, 23\], got \[?(-1|24|-2)"):
            m.take(bad)
    with pytest.raises(TypeError, match="ids should be integers"):
        m.take(np.array([1.0]))


def float32_bound(x, w, want):  # (..., in) f32, (out, in) f64, (..., out) f64 -> the error a float32 product may have
    """Four times float32's own error on this product (NumPy's float32 matmul against float64), plus a
    floor for sums that cancel."""
    f32 = (x @ w.astype(np.float32).T).astype(np.float64)
    return 4 * np.abs(f32 - want).max() + 1e-6 * np.abs(x).sum(-1).max() * np.abs(w).max()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", SUPPORTED)
@pytest.mark.parametrize("tokens", [1, 3, 9, 40])
def test_products_equal_dequantize_then_float32(qtype, kernel, tokens):
    """A few tokens read each row's blocks once (dotted straight from the integers, or the row decoded
    first), more go through decoded tiles and BLAS: all are the float32 product of the decoded weights,
    to float32 rounding (judged against float64)."""
    rng = np.random.default_rng(tokens * 7 + len(qtype))
    rows, cols = 70, 768
    m = QuantizedMatrix(random_blocks(qtype, rows, cols, rng), qtype, (rows, cols))
    w = dequantize_rows(m.raw, qtype, cols).astype(np.float64)
    x = rng.standard_normal((2, tokens, cols)).astype(np.float32)
    want = x.astype(np.float64) @ w.T
    got = m.matmul(x, kernel=kernel)
    assert got.dtype == np.float32 and got.shape == (2, tokens, rows)
    assert np.abs(got - want).max() <= float32_bound(x, w, want)


@pytest.mark.parametrize("qtype", [q for q in SUPPORTED if q not in ("F16", "BF16")])
def test_block_products_for_every_token_count_and_the_same_bits_in_any_group(qtype):
    """The vector block kernels (quant_simd) for 1 to 13 tokens (groups of GROUP and the ones left over),
    against the float64 product of gguf's decoded weights; and each token's result is the same bits
    computed alone, whatever its place among the others (its sums are its own)."""
    from qkv.models.formats import quant_simd
    from qkv.models.formats.quants import _CODE

    rng = np.random.default_rng(len(qtype))
    rows, cols = 131, 512  # (odd: with AVX-512, rows go two at a time, half the rows apart, and one is left)
    m = QuantizedMatrix(random_blocks(qtype, rows, cols, rng), qtype, (rows, cols))
    w = dequantize_rows(m.raw, qtype, cols).astype(np.float64)
    for tokens in range(1, 14):  # groups of 8 (AVX-512) or 4, a group of 4 left, and 1 to 3
        x = rng.standard_normal((tokens, cols)).astype(np.float32)
        out = np.full((tokens, rows), np.nan, np.float32)
        quant_simd.matmul_blocks(m.raw, _CODE[qtype], x, out)
        want = x.astype(np.float64) @ w.T
        assert np.abs(out - want).max() <= float32_bound(x, w, want), tokens
        for t in range(tokens):
            alone = np.full((1, rows), np.nan, np.float32)
            quant_simd.matmul_blocks(m.raw, _CODE[qtype], x[t : t + 1].copy(), alone)
            assert alone.tobytes() == out[t].tobytes(), (tokens, t)


_OTHER_WIDTH = """
import sys
import numpy as np
from qkv.models.formats import quant_simd
from qkv.models.formats.quants import _CODE, QuantizedMatrix
given = np.load(sys.argv[1])
x, got = given["x"], {}
for key in given.files:
    if key.startswith("raw_"):
        qtype = key[4:]
        m = QuantizedMatrix(given[key], qtype, (given[key].shape[0], x.shape[1]))
        for tokens in range(1, len(x) + 1):
            out = np.zeros((tokens, m.shape[0]), np.float32)
            quant_simd.matmul_blocks(m.raw, _CODE[qtype], x[:tokens], out)
            got[f"{qtype} {tokens}"] = out
np.savez(sys.argv[2], width=np.array(quant_simd.GROUP), **got)
"""


def test_block_products_are_the_same_bits_compiled_for_avx2_as_for_this_cpu(tmp_path):
    """numba compiles the kernels for the CPU it runs on: with AVX-512, groups of 8 tokens and two rows at a
    time, with AVX2 (NUMBA_CPU_NAME=haswell here, in a child process) groups of 4 and one row. Each sum is
    made in the same order either way, so a product's bits do not depend on the machine's vector width
    (on a CPU without AVX-512 both sides are AVX2 and this checks the child against the parent only)."""
    import os
    import subprocess
    import sys

    from qkv.models.formats import quant_simd
    from qkv.models.formats.quants import _CODE

    rng = np.random.default_rng(7)
    types = [q for q in SUPPORTED if q not in ("F16", "BF16")]
    x = rng.standard_normal((13, 512)).astype(np.float32)
    raws = {f"raw_{q}": random_blocks(q, 33, 512, rng) for q in types}
    for q, size in (("Q8_0", 34), ("Q4_0", 18), ("Q5_0", 22)):  # scales at float16's ends too (the largest, a subnormal, a negative)
        raws[f"raw_{q}"].reshape(33, 16, size)[0, :3, :2] = np.array([65504, 6e-8, -0.5], np.float16).view(np.uint8).reshape(3, 2)
    np.savez(tmp_path / "given.npz", x=x, **raws)
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", _OTHER_WIDTH, str(tmp_path / "given.npz"), str(tmp_path / "got.npz")], env=env, check=True, timeout=600)
    got = np.load(tmp_path / "got.npz")
    assert int(got["width"]) == 4, "the child compiled for AVX2 (groups of 4)"
    for q in types:
        m = QuantizedMatrix(raws[f"raw_{q}"], q, (33, 512))
        for tokens in range(1, 14):
            out = np.zeros((tokens, 33), np.float32)
            quant_simd.matmul_blocks(m.raw, _CODE[q], x[:tokens], out)
            assert out.tobytes() == got[f"{q} {tokens}"].tobytes(), (q, tokens, quant_simd.GROUP)


def test_every_finite_float16_scale_is_read_exactly_by_each_way_the_kernels_read_it():
    """The kernels read each block's float16 scales from its bytes (no float32 copy is kept): the decoders with
    integer arithmetic, the vector kernels by one conversion instruction (F16C) or by moving the bits
    (elsewhere). All three against NumPy's conversion, for all 63,488 finite float16 values."""
    import llvmlite.ir as ir
    from numba import njit, types
    from numba.extending import intrinsic

    from qkv.models.formats import quant_kernels as qk
    from qkv.models.formats import quant_simd

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    bits = bits[np.isfinite(bits.view(np.float16))]  # (inf and NaN scales are refused when a matrix is made)
    want = bits.view(np.float16).astype(np.float32)
    raw = bits.view(np.uint8)  # little-endian pairs

    @njit
    def decoders(raw, out):
        for i in range(out.shape[0]):
            out[i] = qk._f16(raw, 2 * i)

    def vector(f16c):
        @intrinsic
        def half_at(typingctx, raw, i):
            def codegen(context, b, sig, args):
                arr = context.make_array(sig.args[0])(context, b, args[0])
                return quant_simd._half(b, arr.data, b.mul(args[1], ir.Constant(ir.IntType(64), 2)), f16c=f16c)

            return types.float32(raw, i), codegen

        @njit
        def run(raw, out):
            for i in range(out.shape[0]):
                out[i] = half_at(raw, i)

        return run

    for convert in (decoders, vector(True), vector(False)):
        got = np.empty(len(bits), np.float32)
        convert(raw, got)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [q for q in SUPPORTED])
def test_a_nan_or_infinite_scale_anywhere_is_refused_naming_its_row(qtype):
    per, size = BLOCKS[qtype]
    at = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "F16": [0], "BF16": [0]}.get(qtype, [0])
    for where in at:
        for value in (np.inf, -np.inf, np.nan):
            raw = random_blocks(qtype, 40, 2 * per if per > 1 else 64, np.random.default_rng(1))
            blocks = raw.reshape(40, -1, size)
            word = np.array([value], np.float16).view(np.uint8) if qtype != "BF16" else (np.array([value], np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            blocks[37, -1, where : where + 2] = word
            with pytest.raises(Exception, match=rf"w: 1 {qtype} (block scales|values) are NaN or infinite \(the first in row 37\)"):
                QuantizedMatrix(raw, qtype, (40, raw.shape[1] // size * per), name="w")


def test_block_products_refuse_shapes_that_do_not_agree():
    """The kernels read without bounds checks: their entry checks every shape first."""
    from qkv.models.formats import quant_simd
    from qkv.models.formats.quants import _CODE

    m = QuantizedMatrix(random_blocks("Q8_0", 4, 64, np.random.default_rng(0)), "Q8_0", (4, 64))
    ok_x, ok_out = np.zeros((2, 64), np.float32), np.zeros((2, 4), np.float32)
    for x, out in [(np.zeros((2, 32), np.float32), ok_out), (ok_x, np.zeros((2, 5), np.float32)), (ok_x, np.zeros((3, 4), np.float32))]:
        with pytest.raises(ValueError, match="shapes do not agree"):
            quant_simd.matmul_blocks(m.raw, _CODE["Q8_0"], x, out)
    with pytest.raises(ValueError, match="x should be C-contiguous"):
        quant_simd.matmul_blocks(m.raw, _CODE["Q8_0"], np.zeros((64, 2), np.float32).T, ok_out)
    # another dtype would compile a kernel that reads it as float32 (or fail deep in numba); a code no block type has
    with pytest.raises(TypeError, match="x should be a 2-D float32 array, got float64"):
        quant_simd.matmul_blocks(m.raw, _CODE["Q8_0"], ok_x.astype(np.float64), ok_out)
    with pytest.raises(TypeError, match="raw should be"):
        quant_simd.matmul_blocks(m.raw.view(np.int8), _CODE["Q8_0"], ok_x, ok_out)
    with pytest.raises(ValueError, match="shapes do not agree"):  # rows that are not whole blocks
        quant_simd.matmul_blocks(m.raw[:, :-2], _CODE["Q8_0"], ok_x, ok_out)
    with pytest.raises(ValueError, match="code should be"):
        quant_simd.matmul_blocks(m.raw, 99, ok_x, ok_out)


def test_decoders_and_float_products_refuse_what_their_kernels_would_misread():
    """quant_kernels' entries read without bounds checks too: a shape, dtype or length that does not agree is
    an error naming the argument (an `out` too short had been written past its end)."""
    from qkv.models.formats import quant_kernels as qk
    from qkv.models.formats.quants import _CODE

    assert {SUPPORTED[code]: size for code, size in qk._SIZES.items()} == {t: BLOCKS[t] for t in SUPPORTED if t not in ("F16", "BF16")}  # its copy of the block sizes
    from qkv.models.formats import quant_simd
    from qkv.models.formats.quants import _SCALE_BYTES

    assert {SUPPORTED[code]: tuple(a for a in at if a is not None) for code, at in quant_simd._SCALE_AT.items()} == _SCALE_BYTES  # and of the scales' places
    m = QuantizedMatrix(random_blocks("Q4_K", 4, 256, np.random.default_rng(0)), "Q4_K", (4, 256))
    ok = np.zeros((4, 256), np.float32)
    qk.dequantize_into(m.raw, _CODE["Q4_K"], ok)
    assert np.array_equal(ok, m.dequantize())
    cases = [
        (lambda: qk.dequantize_into(m.raw, _CODE["Q4_K"], np.zeros((4, 255), np.float32)), ValueError, "out shape"),
        (lambda: qk.dequantize_into(m.raw, _CODE["Q4_K"], np.zeros((5, 256), np.float32)), ValueError, "out shape"),
        (lambda: qk.dequantize_into(m.raw[:, :-1], _CODE["Q4_K"], ok), ValueError, "whole blocks of 144 bytes"),
        (lambda: qk.dequantize_into(m.raw[:, :-144], _CODE["Q4_K"], ok), ValueError, "out shape"),
        (lambda: qk.dequantize_into(m.raw.view(np.int8), _CODE["Q4_K"], ok), TypeError, "raw should be"),
        (lambda: qk.matmul_f32(ok, np.zeros((2, 255), np.float32), np.zeros((2, 4), np.float32)), ValueError, "x shape"),
        (lambda: qk.matmul_f32(ok, np.zeros((2, 256), np.float32), np.zeros((2, 3), np.float32)), ValueError, "out shape"),
        (lambda: qk.matmul_lut(np.zeros((4, 8), np.uint16), qk.F16_TABLE[:10], np.zeros((1, 8), np.float32), np.zeros((1, 4), np.float32)), ValueError, "table shape"),
        (lambda: qk.dequantize_lut_into(np.zeros((4, 8), np.int16), qk.F16_TABLE, np.zeros((4, 8), np.float32)), TypeError, "raw16 should be"),
    ]
    for call, kind, named in cases:
        with pytest.raises(kind, match=named):
            call()


def test_stacking_keeps_quantized_parts_without_copying_them():
    rng = np.random.default_rng(0)
    a = QuantizedMatrix(random_blocks("Q5_0", 8, 64, rng), "Q5_0", (8, 64))
    b = QuantizedMatrix(random_blocks("Q5_0", 4, 64, rng), "Q5_0", (4, 64))
    c = QuantizedMatrix(random_blocks("Q8_0", 4, 64, rng), "Q8_0", (4, 64))
    same = stack([a, b])
    assert isinstance(same, StackedMatrix) and same.shape == (12, 64)
    assert same.parts[0].raw is a.raw and same.parts[1].raw is b.raw  # the blocks as given (a mapped file's stay mapped)
    mixed = stack([a, b, c])
    assert isinstance(mixed, StackedMatrix) and mixed.shape == (16, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    full = np.concatenate([a.dequantize(), b.dequantize(), c.dequantize()])
    np.testing.assert_allclose(mixed.matmul(x), x @ full.T, rtol=1e-5, atol=1e-5)
    many = rng.standard_normal((3, 20, 64)).astype(np.float32)  # 60 tokens: the tiles, every part's in one run
    got = mixed.matmul(many)
    assert got.shape == (3, 20, 16) and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.concatenate([p.matmul(many) for p in (a, b, c)], axis=-1))
    np.testing.assert_allclose(got, many @ full.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="should end in 64 values"):
        mixed.matmul(np.zeros((2, 63), np.float32))
    np.testing.assert_array_equal(stack([np.ones((2, 3)), np.zeros((1, 3))]), [[1, 1, 1], [1, 1, 1], [0, 0, 0]])


@pytest.mark.parametrize(
    "args, match",
    [
        ((np.zeros(34, np.uint8), "Q3_K", (1, 32)), "quantization Q3_K is not supported"),
        ((np.zeros(34, np.uint8), "Q8_0", (1, 40)), "a row of 40 values is not a whole number of Q8_0 blocks of 32"),
        ((np.zeros(30, np.uint8), "Q8_0", (1, 32)), r"Q8_0 data of 30 bytes does not hold \(1, 32\) values \(34 bytes\)"),
        ((np.zeros(34, np.float32), "Q8_0", (1, 32)), "does not hold"),
    ],
)
def test_bad_blocks(args, match):
    from qkv.models import ModelError

    with pytest.raises(ModelError, match=match):
        QuantizedMatrix(*args)


@pytest.fixture(scope="module")
def gemma_pair():
    from qkv.models import load_causal_lm

    return load_causal_lm(), load_causal_lm(keep_quantized=False)


def test_the_real_file_kept_quantized_follows_its_dequantized_twin(gemma_pair):
    """Gemma 3 270M Q4_K_M: the weights in their blocks take a quarter of float32's memory, the logits
    stay within float32 rounding of the dequantized model's, and the next token agrees along a long text."""
    quant, full = gemma_pair
    assert quant.nbytes < 0.3 * full.nbytes
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "walkthrough.md").read_text(encoding="utf-8")  # prose, formulas, code
    ids = quant.tokenizer.encode(text)[:700]
    assert len(ids) == 700
    a, b = quant(ids), full(ids)
    assert np.abs(a - b).max() < 2e-3 * np.abs(b).max()
    # The next token agrees at every position, but where the dequantized model's top two are within
    # float32 rounding of each other (then either is the same model's answer).
    top2 = np.sort(b, axis=-1)[:, -2:]
    differ = a.argmax(-1) != b.argmax(-1)
    assert np.all(top2[differ, 1] - top2[differ, 0] < 1e-3 * np.abs(b).max()), np.flatnonzero(differ)
    # That pass decodes tiles for BLAS (bit for bit gguf's values); decoding a token at a time goes through
    # the compiled matrix-vector kernels instead: the same agreement over 160 tokens fed one by one.
    qc, fc = quant.new_cache(), full.new_cache()
    a = np.concatenate([quant(ids[t : t + 1], qc) for t in range(160)])
    b = np.concatenate([full(ids[t : t + 1], fc) for t in range(160)])
    assert np.abs(a - b).max() < 2e-3 * np.abs(b).max()
    top2 = np.sort(b, axis=-1)[:, -2:]
    differ = a.argmax(-1) != b.argmax(-1)
    assert np.all(top2[differ, 1] - top2[differ, 0] < 1e-3 * np.abs(b).max()), np.flatnonzero(differ)
    assert quant.generate("The capital of France is", max_new_tokens=24).token_ids == full.generate("The capital of France is", max_new_tokens=24).token_ids


def test_gguf_tokenizers_are_cached_and_read_back_the_same(tmp_path, monkeypatch):
    """The vocabulary's tokenizer is built once per vocabulary and read back from qkv's cache after."""
    from qkv.models import load_causal_lm
    from qkv.models.formats import tokenizer
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    first = load_causal_lm().tokenizer
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1
    monkeypatch.setattr(tokenizer, "_spm_merges", lambda tokens, scores: (_ for _ in ()).throw(AssertionError("rebuilt")))
    second = load_causal_lm().tokenizer  # from the cache: the merges are not recovered again
    text = "Hello  world, café  naïve\n  <start_of_turn>user\nx"
    assert second.encode(text) == first.encode(text) and second.decode(first.encode(text)) == first.decode(first.encode(text))
    (next((tmp_path / "tokenizers").glob("*.json"))).write_text("{not json")  # a damaged cache is rebuilt
    monkeypatch.undo()
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    assert load_causal_lm().tokenizer.encode(text) == first.encode(text)


def test_loading_keeps_the_file_out_of_resident_memory():
    """The kept blocks are views of the mapped file, never a second copy of it in the process (the
    tokenizer is read first and its parser's freed heap handed back, so its peak does not come on top)."""
    import subprocess
    import sys

    # VmHWM, the peak of this process's own memory (getrusage's maxrss carries a forking parent's peak over)
    script = ("from qkv.models import load_causal_lm; lm = load_causal_lm(); "
              "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]; print(int(hwm) // 1024, lm.nbytes // 2**20)")  # fmt: skip
    peak, weights = map(int, subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True).stdout.split())
    assert weights < 300 and peak < 680, (peak, weights)  # 264 MiB of weights; 536 MiB here, 767 when the blocks were copied


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefill_tiles_are_shared_evenly_by_the_workers(threads):
    """Tiles of at most TILE_ROWS rows whose number the workers share evenly: the busiest worker multiplies
    at most a few rows more than an even share (a 768-row matrix in three tiles of 256 gave one of two
    workers 512 rows, a third more than its share)."""
    import qkv
    from qkv.models.formats import quants

    with qkv.set_num_threads(threads):
        for rows in (1, 5, 200, 256, 257, 768, 1280, 2048, 4096, 262144):
            step = quants._tile_rows(rows)
            tiles = -(-rows // step)
            assert 1 <= step <= quants.TILE_ROWS and tiles * step >= rows
            if rows >= 8 * threads:
                sizes = [min(step, rows - i * step) for i in range(tiles)]
                busiest = sum(sizes[::threads])  # the tiles handed out in turn: the first worker's rows
                assert busiest <= 1.01 * rows / threads + threads, (rows, step, tiles)
        if threads == 1:
            assert [quants._tile_rows(r) for r in (5, 640, 768, 5000)] == [5, 256, 256, 256]  # one worker: 256-row tiles, as ever
