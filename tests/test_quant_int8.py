"""llama.cpp's int8 activations (qkv.models.formats.quant_int8, opt-in): each block type's product equals
the float64 product of gguf's decoded weights and the activations rounded as llama.cpp's Q8_0 rounds them,
to float32 rounding; a token's result is the same in any batch; AVX2 and the plain-vector fallback give the
VNNI path's bits; the switch is scoped; and a decode step in this mode is the NumPy path's, bit for bit."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import gguf_writer
from numba import njit
from qkv.models import load_causal_lm
from qkv.models.engines import decode_step
from qkv.models.formats import quant_int8, quants
from qkv.models.formats.quants import QuantizedMatrix, int8_activations
from qkv.models.load import default_causal_lm_path

TYPES = ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]


def _matrix(qtype, rows, cols, rng):
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        raw = gguf_writer.random_kquant_rows(qtype, rows, cols, rng)
    else:
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q[qtype])
    return QuantizedMatrix(raw, qtype, (rows, cols))


def _rounded(x):  # llama.cpp's Q8_0 rounding of activations, written out in float64: (T, N) -> (T, N)
    blocks = x.astype(np.float64).reshape(len(x), -1, 32)
    step = (np.abs(x).reshape(len(x), -1, 32).max(-1) / np.float32(127)).astype(np.float32)  # the scale as stored
    inv = np.where(step > 0, np.float32(1) / np.where(step > 0, step, 1), 0).astype(np.float32)
    q = np.clip(np.rint(x.reshape(len(x), -1, 32) * inv[..., None]), -127, 127)
    return (q * step[..., None].astype(np.float64)).reshape(x.shape), blocks


@pytest.mark.parametrize("qtype", TYPES)
def test_each_type_is_the_product_of_the_rounded_activations(qtype):
    rng = np.random.default_rng(TYPES.index(qtype))
    m = _matrix(qtype, 96, 512, rng)
    x = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 30, size=(6, 1))).astype(np.float32)
    x[1, :32] = 0  # a block of zeros: scale 0
    w = dequantize(m.raw.reshape(-1), Q[qtype]).reshape(96, 512).astype(np.float64)  # the format's own reader
    xr, _ = _rounded(x)
    want = xr @ w.T
    with int8_activations():
        got = m.matmul(x)
    assert got.dtype == np.float32
    scale = np.abs(xr) @ np.abs(w).T  # the sum of |terms|: float32 rounding is relative to it
    assert np.all(np.abs(got - want) <= 2e-6 * scale + 1e-30)
    exact = x.astype(np.float64) @ w.T
    assert np.abs(got - exact).max() > 0  # it is not the float32 path


@pytest.mark.parametrize("qtype", TYPES)
def test_a_token_gets_the_same_bits_in_any_batch(qtype):
    rng = np.random.default_rng(7)
    m = _matrix(qtype, 40, 256, rng)
    x = rng.standard_normal((9, 256)).astype(np.float32)
    with int8_activations():
        alone = np.stack([m.matmul(x[t : t + 1])[0] for t in range(9)])
        for n in (2, 3, 6, 7, 9):  # groups of 4 tokens sharing each block's unpacking, then the 1-3 left as one
            together = np.concatenate([m.matmul(x[t : t + n]) for t in range(0, 9, n)])
            np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0", "Q6_K", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("off", [("VNNI",), ("VNNI", "AVX2")])
def test_the_plain_vector_fallback_and_avx2_give_the_vnni_bits(qtype, off, monkeypatch):
    """The same integers by vpdpbusd (AVX-512 VNNI, where this CPU has it), by vpmaddubsw + vpmaddwd
    (AVX2), and by plain vector code: the same bits, extreme bytes included (Q8_0's -128 against
    activations of +-127, the largest pair vpmaddubsw adds)."""
    rng = np.random.default_rng(3)
    m = _matrix(qtype, 32, 512, rng)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    if qtype == "Q8_0":  # row 0's first block: every value -128; token 0's first 32 activations +-127 after rounding
        raw = m.raw.copy()
        raw[0, 2:34] = 0x80
        m = QuantizedMatrix(raw, qtype, (32, 512))
        x[0, :32] = np.where(np.arange(32) % 3 == 0, -1.0, 1.0)
    want = np.empty((3, 32), np.float32)
    quant_int8.matmul_blocks_int8(m.raw, quants._CODE[qtype], x, want)
    for flag in off:
        monkeypatch.setattr(quant_int8, flag, False)  # read when the kernel is generated: a fresh one
    kernel = quant_int8._row_dots_int8(quants._CODE[qtype])

    @njit
    def run(raw, x, out):
        xq, dx, sums = quant_int8._quantize_activations(x)  # (in compiled code: the checked entry is Python)
        for r in range(raw.shape[0]):
            kernel(raw, xq, dx, sums, r, out)

    got = np.empty_like(want)
    run(m.raw, x, got)
    np.testing.assert_array_equal(got, want)


def test_rounding_the_activations_as_llama_cpp():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 128)) * 5).astype(np.float32)
    x[2, 64:96] = 0
    xq, dx, sums = quant_int8.quantize_activations(x)
    assert xq.dtype == np.int8 and dx.dtype == sums.dtype == np.float32
    assert np.abs(xq).max() == 127 and (xq[2, 64:96] == 0).all() and dx[2, 2] == 0
    np.testing.assert_array_equal(xq.reshape(3, -1, 32).sum(-1), sums)
    want, _ = _rounded(x)
    np.testing.assert_array_equal((xq.reshape(3, -1, 32) * dx[..., None].astype(np.float64)).reshape(3, 128), want)
    with pytest.raises(ValueError, match="whole blocks of 32"):  # the last 8 values would have been left out, unwritten
        quant_int8.quantize_activations(x[:, :40].copy())


def test_nan_and_inf_come_out_as_nan_not_as_numbers():
    m = _matrix("Q8_0", 8, 64, np.random.default_rng(0))
    x = np.ones((2, 64), np.float32)
    x[0, 3], x[1, 40] = np.nan, np.inf
    with int8_activations():
        got = m.matmul(x)
    assert np.isnan(got).all()


def test_the_switch_is_scoped_and_prompts_stay_float32():
    rng = np.random.default_rng(1)
    m = _matrix("Q5_0", 64, 256, rng)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    base = m.matmul(x)
    with int8_activations():
        on = m.matmul(x)
        assert quants.int8_active()
        with int8_activations(False):
            np.testing.assert_array_equal(m.matmul(x), base)
        many = rng.standard_normal((quants.DIRECT_TOKENS + 1, 256)).astype(np.float32)
        with int8_activations(False):
            want = m.matmul(many)
        np.testing.assert_array_equal(m.matmul(many), want)  # a prompt's product: float32 tiles either way
    assert not quants.int8_active() and not np.array_equal(on, base)
    np.testing.assert_array_equal(m.matmul(x), base)


def test_an_int8_decode_step_is_the_numpy_paths_and_close_to_float32(monkeypatch):
    lm = load_causal_lm(default_causal_lm_path())
    ids = lm.tokenizer.encode("The capital of France is")

    def steps(enabled, int8, n=8):
        monkeypatch.setattr(decode_step, "ENABLED", enabled)
        with int8_activations(int8):
            cache = lm.new_cache()
            out = [lm.forward(ids, cache, logits_to_keep=1).logits[0, -1]]
            for tok in [506, 5279, 529, 506, 2891, 529, 7001, 236761][:n]:  # the same tokens for every mode
                out.append(lm.forward([tok], cache).logits[0, -1])
        return np.stack(out)

    int8 = steps(True, True)
    np.testing.assert_array_equal(int8, steps(False, True))
    ref = steps(True, False)
    err = np.abs(int8 - ref).max(-1)  # (a 6-token prompt's products are few-token products too)
    assert (err > 0).all() and (err < 0.1 * np.abs(ref).max(-1)).all()
