import pytest
import torch

from tinyloop.quant.gptq import block_update, column_update, gptq_quantize, inverse_hessian_factor
from tinyloop.quant.packing import dequantize, quantize_rtn


def correlated_inputs(K: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = max(2, K // 4)  # inputs live near a low-rank subspace, with uneven channel energy, like activations
    mix = torch.randn(r, K, generator=g, dtype=torch.float64)
    scales = torch.logspace(0, 1, K, dtype=torch.float64)
    X = torch.randn(n, r, generator=g, dtype=torch.float64) @ mix + 0.1 * torch.randn(n, K, generator=g, dtype=torch.float64)
    return X * scales  # (n, K)


def output_error(W, W_hat, X):
    return float(((W - W_hat) @ X.t()).pow(2).sum() / (W @ X.t()).pow(2).sum())


def test_column_update_is_the_least_squares_compensation():
    # Quantizing column 0 to a fixed value, the best remaining columns (min ||(W' - W) X^T||) are what
    # column_update gives with row 0 of the inverse Hessian's upper Cholesky factor.
    K, n = 12, 200
    X = correlated_inputs(K, n)
    H = X.t() @ X / n
    W = torch.randn(5, K, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q0 = W[:, 0] + 0.3
    U = inverse_hessian_factor(H, percdamp=0.0)
    err = (W[:, 0] - q0) / U[0, 0]
    rest = column_update(W[:, 1:], err, U[0, 1:])
    # reference: solve min_R ||(q0 x0 + R X_rest) - W X||, i.e. R X_rest ~= W X - q0 x0
    target = X @ W.t() - X[:, :1] * q0[None, :]
    R_ref = torch.linalg.lstsq(X[:, 1:], target).solution.t()
    assert torch.allclose(rest, R_ref, atol=1e-8)


def test_block_update_equals_successive_column_updates():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(4, 6, dtype=torch.float64, generator=g)
    errs = torch.randn(4, 3, dtype=torch.float64, generator=g)
    U = torch.randn(3, 6, dtype=torch.float64, generator=g)
    seq = W.clone()
    for i in range(3):
        seq = column_update(seq, errs[:, i], U[i])
    assert torch.allclose(block_update(W, errs, U), seq)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_correlated_inputs(bits, act_order):
    K, N, n = 128, 48, 2048
    X = correlated_inputs(K, n, seed=bits)
    H = X.t() @ X / n
    W = torch.randn(N, K, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 0.02
    q, s, z = gptq_quantize(W, H, bits, 32, act_order=act_order, blocksize=32)
    assert q.dtype == torch.uint8 and s.shape == (N, K // 32) and int(q.max()) < 2 ** bits
    e_gptq = output_error(W, dequantize(q, s, z).double(), X)
    e_rtn = output_error(W, dequantize(*quantize_rtn(W, bits, 32)).double(), X)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_gptq_with_identity_hessian_is_rtn():
    # With uncorrelated inputs there is nothing to compensate with: GPTQ is exactly RTN.
    W = torch.randn(16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    q, s, z = gptq_quantize(W, torch.eye(64, dtype=torch.float64), 4, 32)
    q_r, s_r, z_r = quantize_rtn(W, 4, 32)
    assert torch.equal(q, q_r) and torch.equal(s, s_r) and torch.equal(z, z_r)
