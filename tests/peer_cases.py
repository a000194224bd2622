"""The case families of the peers' attention test suites, and FlashAttention's way of judging float32.

Families (shapes, masks and biases as the suites draw them):

- ``flash``: FlashAttention's ``test_flash_attn`` sequence-length pairs (odd, unequal, L > S and L < S)
  and head dims (32, 59, 64, 128), causal or not, MHA / GQA / MQA;
- ``window``: the same shapes with local windows ``(left, right)``;
- ``alibi``: ALiBi biases ``-slope * |i + S - L - j|`` with FlashAttention's random slopes;
- ``padding``: key padding of random lengths (PyTorch ``test_transformers``' key_padding_mask);
- ``positive``: all-positive inputs (``torch.rand``), short and long key ranges;
- ``sharp``: inputs scaled x4, so that the weights are nearly one-hot (JAX ``nn_test`` scales);
- ``bias_mask``: a random float bias and a random boolean mask together (JAX ``dot_product_attention``).

Judging (FlashAttention's tests): the error of qkv's float32 result against a float64 reference,
divided by the error of PyTorch's float32 math SDPA against the same reference. A ratio <= 2 means
qkv is as accurate as the reference implementation in the same precision.
"""

from __future__ import annotations

import numpy as np

FLASH_SHAPES = [(1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]
HEAD_DIMS = [32, 59, 64, 128]
HEADS = [(4, 4), (6, 2), (4, 1)]
FAMILIES = ["flash", "window", "alibi", "padding", "positive", "sharp", "bias_mask"]


def cases(family: str, seed: int = 0, limit: int | None = None, max_len: int = 2048):
    """Yield dicts ``{name, q, k, v, mask, bias}`` (float64 NumPy, bool mask) of one family."""
    rng = np.random.default_rng(seed + FAMILIES.index(family) * 1000)
    n = 0
    for L, S in FLASH_SHAPES:
        if max(L, S) > max_len:
            continue
        D = HEAD_DIMS[n % len(HEAD_DIMS)]
        Hq, Hk = HEADS[n % len(HEADS)]
        causal = n % 2 == 1
        B = 2
        draw = rng.random if family == "positive" else rng.standard_normal
        q, k, v = draw((B, Hq, L, D)), draw((B, Hk, S, D)), draw((B, Hk, S, D))
        if family == "sharp":
            q, k = 4 * q, 4 * k
        i = np.arange(L)[:, None] + (S - L)
        j = np.arange(S)[None, :]
        keep = np.ones((L, S), bool)
        if causal:
            keep &= j <= i
        mask, bias = None, None
        if family == "window":
            left, right = [(16, 0), (64, 32), (200, 7), (0, 0)][n % 4]
            keep &= (j >= i - left) & (j <= i + right)
        if family == "alibi":
            slopes = rng.random(Hq) * 0.3
            bias = -slopes[None, :, None, None] * np.abs(i - j)[None, None]
            bias = np.broadcast_to(bias, (B, Hq, L, S))
        if family == "padding":
            lengths = rng.integers(max(1, S // 4), S + 1, size=B)
            keep = keep[None, None] & (np.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
        if family == "bias_mask":
            bias = rng.standard_normal((B, Hq, L, S))
            keep = keep[None, None] & (rng.random((B, Hq, L, S)) < 0.8)
        keep = np.broadcast_to(keep, (B, Hq, L, S)).copy()
        keep[..., :, 0] |= ~keep.any(-1)  # every query sees at least one key (torch's math path gives NaN otherwise)
        if not keep.all():
            mask = keep
        yield {"name": f"{family}-L{L}-S{S}-D{D}-H{Hq}/{Hk}" + ("-causal" if causal else ""), "q": q, "k": k, "v": v, "mask": mask, "bias": bias}
        n += 1
        if limit is not None and n >= limit:
            return


IMPLEMENTATIONS = ["direct", "tiled", "torch-reordered"]


def error_ratio(case, torch, implementation: str) -> tuple[float, float, float, float]:
    """(ratio, max error, torch's max error, allowance) for a float32 ``implementation``.

    ``implementation``: qkv's ``"direct"`` or ``"tiled"`` path, or ``"torch-reordered"``:
    torch's float32 math SDPA itself on the same case with its keys (and values, mask
    and bias columns) in another order, which changes nothing but the order of the
    sums. Its ratio is the reference's own spread: how far a max error moves against
    another one of equal accuracy.

    ``allowance`` is the rounding term FlashAttention's newer tests add to the bound
    (``err <= 2 * err_torch + fwd_atol``, ``fwd_atol = 2 * max|(ref + 0.3) - 0.3 - ref|`` in the
    tested dtype): reported beside the strict ratio, never folded into it.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qkv import scaled_dot_product_attention as sdpa

    q, k, v, mask, bias = case["q"], case["k"], case["v"], case["mask"], case["bias"]
    G = q.shape[1] // k.shape[1]
    add = np.zeros(q.shape[:-1] + (k.shape[-2],)) if bias is None else np.array(bias)
    if mask is not None:
        add = np.where(mask, add, -np.inf)

    def torch_sdpa(dtype, order=slice(None)):
        t = [torch.tensor(x, dtype=dtype) for x in (q, np.repeat(k[..., order, :], G, axis=1), np.repeat(v[..., order, :], G, axis=1))]
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=torch.tensor(add[..., order], dtype=dtype)).numpy().astype(np.float64)

    ref = torch_sdpa(torch.float64)
    pt = torch_sdpa(torch.float32)
    if implementation == "torch-reordered":
        order = np.random.default_rng(k.shape[-2]).permutation(k.shape[-2])
        if not np.allclose(torch_sdpa(torch.float64, order), ref, rtol=0, atol=1e-12):
            raise RuntimeError(f"{case['name']}: reordered keys changed the float64 result; mask or bias columns not reordered with them")
        ours = torch_sdpa(torch.float32, order)
    else:
        f32 = lambda x: None if x is None else np.asarray(x, np.float32)  # noqa: E731
        ours = sdpa(f32(q), f32(k), f32(v), mask=mask, bias=f32(bias), implementation=implementation).astype(np.float64)
    e_ours, e_pt = float(np.abs(ours - ref).max()), float(np.abs(pt - ref).max())
    floor = 0.5 * np.finfo(np.float32).eps * float(np.abs(ref).max())  # both exact to rounding: no ratio of noise
    ref32 = ref.astype(np.float32)
    allowance = 2 * float(np.abs((ref32 + np.float32(0.3)) - np.float32(0.3) - ref32).max(initial=0))
    return e_ours / max(e_pt, floor), e_ours, e_pt, allowance
