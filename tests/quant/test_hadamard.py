import pytest
import torch

from tinyloop.quant.hadamard import fwht, hadamard_matrix


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_is_orthonormal_and_its_own_inverse(n):
    H = hadamard_matrix(n, torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    assert torch.allclose(H @ H.t(), eye, atol=1e-12)
    assert torch.allclose(H @ H, eye, atol=1e-12)  # symmetric: H^-1 = H
    assert torch.allclose(H.abs(), torch.full_like(H, n ** -0.5))


@pytest.mark.parametrize("n", [2, 8, 64])
def test_fwht_matches_matrix_and_inverts(n):
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    y = fwht(x)
    assert torch.allclose(y, x @ hadamard_matrix(n, torch.float64), atol=1e-12)
    assert torch.allclose(fwht(y), x, atol=1e-12)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))  # rotation keeps lengths


def test_hadamard_spreads_an_outlier():
    x = torch.zeros(64, dtype=torch.float64)
    x[5] = 8.0
    y = fwht(x)
    assert torch.allclose(y.abs(), torch.full_like(y, 1.0))


def test_non_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(48)
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(2, 12))
