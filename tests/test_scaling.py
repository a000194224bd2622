import numpy as np

from qkv.scaling import score_statistics


def test_unscaled_variance_grows_like_d_and_scaled_stays_near_one():
    s = score_statistics([1, 16, 256], samples=3000, rng=0)
    # Var(q . k) = D for unit-variance entries: within sampling error (~3% here)
    np.testing.assert_allclose(s["unscaled_var"], s["dim"], rtol=0.08)
    np.testing.assert_allclose(s["scaled_var"], 1.0, rtol=0.08)
    assert s["unscaled_max_weight"][-1] > 0.85 > s["scaled_max_weight"][-1]
    assert np.ptp(s["scaled_max_weight"]) < 0.1


def test_seeded():
    a, b = score_statistics([4], rng=3), score_statistics([4], rng=np.random.default_rng(3))
    assert a["unscaled_var"][0] == b["unscaled_var"][0]
