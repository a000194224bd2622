"""One token's Q4_K products with its activations in three int8 slices (qkv.models.formats.quant_sliced): the
slices hold each activation to float32's precision (checked against the rounding written out in NumPy); the
product's error against float64 is no larger than NumPy's float32 product of the dequantized weights (BLAS),
with normal activations and with outliers; NaN and inf come out as the float kernels give them; and the
product is taken only where it may be (one token, Q4_K, not under row_invariant or int8_activations)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

import gguf_writer
from qkv.models.formats import quant_simd, quant_sliced, quants
from qkv.models.formats.quants import QuantizedMatrix, int8_activations, row_invariant

pytestmark = pytest.mark.skipif(not quant_sliced.AVAILABLE, reason="the sliced kernel needs AVX-512 VNNI (this CPU has not; quant_simd's kernel runs instead)")


def _q4k(rows, cols, rng):
    return QuantizedMatrix(gguf_writer.random_kquant_rows("Q4_K", rows, cols, rng), "Q4_K", (rows, cols))


def _activations(cols, rng, kind):  # (1, cols) float32
    x = rng.standard_normal((1, cols)).astype(np.float32)
    if kind == "outliers":  # a few channels 60x the rest, as in real models' hidden states
        x[0, rng.choice(cols, 6, replace=False)] *= 60
    elif kind == "scales":  # each run of 32 at its own scale, 1e-30 to 1e30
        x *= (10.0 ** rng.uniform(-30, 30, size=(1, cols // 32))).repeat(32, axis=1).astype(np.float32)
    return x


def _unslice(slices):  # (T, 3, N) int8 -> m (T, N) int64, the runs back in file order
    m = slices[:, 0].astype(np.int64) * 65536 + slices[:, 1].astype(np.int64) * 256 + slices[:, 2]
    T, n = m.shape
    sb = m.reshape(T, n // 256, 8, 32)  # (T, super-blocks, slot, value)
    return sb[:, :, list(quant_sliced.ORDER.index(j) for j in range(8))].reshape(T, n)


def test_slices_hold_each_activation_to_float32s_precision():
    rng = np.random.default_rng(0)
    x = np.concatenate([_activations(512, rng, kind) for kind in ("normal", "outliers", "scales")])  # (3, 512)
    x[0, 32:64] = 0  # a run of zeros
    x[1, 64:96] = np.float32(3e-39)  # a run below the smallest normal float32
    x[2, 96] = np.inf
    x[2, 160] = np.nan
    slices, steps, sums = quant_sliced.slice_activations(x)
    assert slices.dtype == np.int8 and steps.dtype == sums.dtype == np.float32
    # the runs are placed by super-block: a row of a part of one would have been written past its end
    with pytest.raises(ValueError, match="super-blocks of 256"):
        quant_sliced.slice_activations(x[:, :32].copy())
    with pytest.raises(TypeError, match="float32"):
        quant_sliced.slice_activations(x.astype(np.float64))
    assert slices.shape == (3, 3, 512) and steps.shape == sums.shape == (3, 16)
    # the rounding, written out here in float64: the step a power of two, the largest |m| as large as three
    # signed bytes allow (8,355,711), m = x / step rounded to the nearest integer
    runs = x.astype(np.float64).reshape(3, 16, 32)
    top = np.abs(runs).max(-1)
    bad = ~np.isfinite(runs).all(-1)
    tiny = top < 2.0**-126
    e = np.frexp(np.where(bad | tiny, 1.0, top))[1]
    step = 2.0 ** (e - 23.0)
    step = np.where(top / step > 8355711, step * 2, step)
    m = np.rint(np.where(bad[..., None] | tiny[..., None], 0, runs) / step[..., None])
    ok = ~bad & ~tiny
    np.testing.assert_array_equal(_unslice(slices).reshape(3, 16, 32)[ok], m[ok])
    np.testing.assert_array_equal(steps[ok], step[ok].astype(np.float32))
    np.testing.assert_array_equal(sums[ok], (step * m.sum(-1))[ok].astype(np.float32))
    assert np.isnan(steps[bad]).all() and np.isnan(sums[bad]).all() and bad.sum() == 2
    assert (steps[tiny] == 0).all() and (sums[tiny] == 0).all() and tiny.sum() == 2
    # float32's precision at the run's largest value: |m| >= 8,355,711 / 2 (about 2^22) there, every value
    # within half a step
    assert (np.abs(m).max(-1)[ok] >= 8355711 / 2).all()
    assert (np.abs(m * step[..., None] - runs)[ok] <= step[ok][:, None] / 2).all()


@pytest.mark.parametrize("kind", ["normal", "outliers", "scales"])
def test_the_products_error_is_no_larger_than_float32_blas(kind):
    """Against float64, the largest error at most twice that of NumPy's float32 product of the dequantized
    weights (BLAS), as FlashAttention's tests judge a float kernel; the mean error at most 2.5x BLAS's.
    Measured here: the largest 0.5-1.4x, the mean 0.6-2.1x (2.1x with outliers: a run's values share the
    step of its largest, so a value 60x smaller than it keeps 17 bits); on a Llama file's matrices 0.3-0.8x
    and 0.5-1.1x."""
    rng = np.random.default_rng(["normal", "outliers", "scales"].index(kind))
    for rows, cols in ((256, 768), (96, 2048)):
        m = _q4k(rows, cols, rng)
        w = dequantize(m.raw.reshape(-1), Q.Q4_K).reshape(rows, cols)  # gguf's own reader
        errs, blas = [], []
        for _ in range(8):
            x = _activations(cols, rng, kind)
            want = x.astype(np.float64) @ w.astype(np.float64).T
            got = np.empty((1, rows), np.float32)  # the kernel itself (routing is tested below)
            quant_sliced.matmul_blocks_sliced(m.raw, quants._CODE["Q4_K"], x, got)
            scale = np.abs(want).max()
            errs.append(np.abs(got - want) / scale)
            blas.append(np.abs((x @ w.T) - want) / scale)
        errs, blas = np.concatenate(errs), np.concatenate(blas)
        assert errs.max() <= 2 * blas.max(), (kind, rows, cols, errs.max() / blas.max())
        assert errs.mean() <= 2.5 * blas.mean(), (kind, rows, cols, errs.mean() / blas.mean())


def test_inf_and_nan_come_out_as_the_float_kernels_give_them():
    rng = np.random.default_rng(3)
    m = _q4k(64, 512, rng)
    for value in (np.inf, -np.inf, np.nan):
        x = rng.standard_normal((1, 512)).astype(np.float32)
        x[0, 100] = value
        got, ref = np.empty((1, 64), np.float32), np.empty((1, 64), np.float32)
        quant_sliced.matmul_blocks_sliced(m.raw, quants._CODE["Q4_K"], x, got)
        quant_simd.matmul_blocks(m.raw, quants._CODE["Q4_K"], x, ref)
        assert np.isnan(got).all() and np.isnan(ref).all()  # (a zero weight times inf is NaN too: the offsets)
    x = np.zeros((1, 512), np.float32)
    got = np.empty((1, 64), np.float32)
    quant_sliced.matmul_blocks_sliced(m.raw, quants._CODE["Q4_K"], x, got)
    assert (got == 0).all()


def test_it_takes_one_token_of_q4_k_only_and_says_so():
    rng = np.random.default_rng(4)
    m = _q4k(8, 256, rng)
    out = np.empty((2, 8), np.float32)
    with pytest.raises(ValueError, match="one token of Q4_K, got 2 tokens"):
        quant_sliced.matmul_blocks_sliced(m.raw, quants._CODE["Q4_K"], rng.standard_normal((2, 256)).astype(np.float32), out)


def test_the_product_is_taken_for_one_token_outside_row_invariant_and_int8_only():
    rng = np.random.default_rng(5)
    m = _q4k(48, 512, rng)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    code = quants._CODE["Q4_K"]

    def simd(xs):
        out = np.empty((len(xs), 48), np.float32)
        quant_simd.matmul_blocks(m.raw, code, xs, out)
        return out

    sliced = np.empty((1, 48), np.float32)
    quant_sliced.matmul_blocks_sliced(m.raw, code, x[:1], sliced)
    assert sliced.tobytes() != simd(x[:1]).tobytes()  # the two kernels' bits differ: the checks below can tell them apart
    assert m.matmul(x[:1]).tobytes() == sliced.tobytes()  # one token: sliced
    assert m.matmul(x).tobytes() == simd(x).tobytes()  # three: quant_simd's, which shares each block's unpacking
    with row_invariant():  # one kernel whatever the number of tokens: a token's bits the same alone and batched
        alone = m.matmul(x[:1])
        assert alone.tobytes() == simd(x[:1]).tobytes() == m.matmul(x)[:1].tobytes()
        assert not quants.sliced_active()
    with int8_activations():
        assert not quants.sliced_active()
        assert m.matmul(x[:1]).tobytes() != sliced.tobytes()
    assert quants.sliced_active()


def test_rows_taken_in_pairs_give_each_row_its_own_bits():
    """Rows go two at a time, half the matrix apart, and an odd one alone: each row's result is the one it
    gets as a matrix of one row."""
    rng = np.random.default_rng(6)
    m = _q4k(37, 512, rng)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    code = quants._CODE["Q4_K"]
    out = np.empty((1, 37), np.float32)
    quant_sliced.matmul_blocks_sliced(m.raw, code, x, out)
    for r in range(37):
        alone = np.empty((1, 1), np.float32)
        quant_sliced.matmul_blocks_sliced(m.raw[r : r + 1], code, x, alone)
        assert alone.tobytes() == out[:, r].tobytes(), r


def test_a_stacked_matrix_sliced_once_gives_each_part_its_own_bits():
    """The parts of a stacked matrix (q, k and v; gate and up) in one call with x sliced once: each part's
    columns are the bits that part gives alone, odd parts and an empty one (a step's placeholder) included."""
    rng = np.random.default_rng(7)
    parts = [_q4k(rows, 512, rng) for rows in (37, 8, 15)]
    empty = quants._read_only(np.zeros((0, 0), np.uint8))  # as decode_step passes it
    x = rng.standard_normal((1, 512)).astype(np.float32)
    codes = np.full(4, quants._CODE["Q4_K"], np.int64)
    assert quant_sliced.takes_all(codes, 1) and not quant_sliced.takes_all(codes, 2)
    assert not quant_sliced.takes_all(np.array([quants._CODE["Q4_K"], quants._CODE["Q6_K"]]), 1)
    raws = tuple(m.raw for m in parts)
    out = np.full((1, 60), np.nan, np.float32)
    quant_sliced._matmul_parts_parallel((*raws[:2], empty, raws[2]), x, out)
    alone = [np.empty((1, m.raw.shape[0]), np.float32) for m in parts]
    for m, a in zip(parts, alone):
        quant_sliced.matmul_blocks_sliced(m.raw, quants._CODE["Q4_K"], x, a)
    assert out.tobytes() == np.concatenate(alone, axis=1).tobytes()
