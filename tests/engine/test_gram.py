"""``engine.gram.gram`` (Gram matrices by symmetric blocks) against the plain product."""

from __future__ import annotations

import pytest
import torch

from backprism.engine.gram import gram


@pytest.mark.parametrize(
    "shape",
    [
        (7, 5),
        (255, 3),
        (300, 4),
        (1100, 2),
        (256, 512),
        (300, 515),
        (511, 600),
        (513, 512),
        (1100, 530),
        (3, 520, 512),
    ],
)
def test_gram_equals_the_product(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    a = torch.randn(*shape, dtype=torch.float64)
    out = gram(a)
    torch.testing.assert_close(out, a @ a.mT, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gram(a, 7.0), a @ a.mT / 7, rtol=1e-12, atol=1e-12)


def test_gram_of_a_transposed_view_and_with_gradients() -> None:
    torch.manual_seed(1)
    x = torch.randn(600, 600, dtype=torch.float64)
    torch.testing.assert_close(gram(x.t()), x.t() @ x, rtol=1e-12, atol=1e-12)
    a = torch.randn(600, 512, dtype=torch.float64, requires_grad=True)
    # the plain product under autograd: d Σ(a aᵀ) / da = 2·1·1ᵀa
    (gram(a, 2.0) * 2).sum().backward()
    torch.testing.assert_close(a.grad, 2 * a.detach().sum(0).expand(600, 512))
