"""``ViViTGGNExact``/``ViViTGGNMC`` with repeated sub-sampling indices (ViViT's own suite uses
``subsampling=[0, 0, 1, 0, 1]``), against dense float64 GGN blocks from ``torch.func``.

ViViT's meaning (its layers ``index_select`` the stored inputs and BackPACK's loss square root
the logits): ``V_𝒮 = V[:, 𝒮]``, a column block per occurrence, so that
``V_𝒮 V_𝒮ᵀ = Σᵢ GGN_{sᵢ}`` (a repeated sample counted once per occurrence, no rescaling).
ViViT's spectral computations reject repeated indices (``check_subsampling_unique``), and so
do backprism's.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from backprism.compat.backpack import backpack, extend
from backprism.compat.vivit.extensions.secondorder.vivit import ViViTGGNExact, ViViTGGNMC
from backprism.compat.vivit.linalg.eigvalsh import EigvalshComputation
from tests.reference import ggn_blocks

N, D_IN, HID, D_OUT = 4, 5, 4, 3
DT = torch.double
SUB = [0, 0, 1, 0, 1]


def setup(loss: str) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    X = torch.randn(N, D_IN, dtype=DT)
    model = nn.Sequential(nn.Linear(D_IN, HID), nn.Tanh(), nn.Linear(HID, D_OUT)).to(DT)
    if loss == "mse":
        return model, nn.MSELoss(), X, torch.randn(N, D_OUT, dtype=DT)
    return model, nn.CrossEntropyLoss(reduction="sum"), X, torch.tensor([0, 2, 1, 2])


def occurrence_sum(model: nn.Module, lossfunc: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    """``Σᵢ GGN_{sᵢ}`` ``[P, P]`` over the occurrences in :data:`SUB`."""
    G = ggn_blocks(model, lossfunc, X, y)[0]
    return torch.stack([G[n, n] for n in SUB]).sum(0)


def param_slices(model: nn.Module) -> list[tuple[nn.Parameter, slice]]:
    out, offset = [], 0
    for p in model.parameters():
        out.append((p, slice(offset, offset + p.numel())))
        offset += p.numel()
    return out


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_vivit_ggn_exact_repeated_subsampling(loss):
    model, lossfunc, X, y = setup(loss)
    ref = occurrence_sum(model, lossfunc, X, y)
    extend(model), extend(lossfunc)
    ext = ViViTGGNExact(subsampling=SUB)
    assert ext.get_subsampling() == SUB
    with backpack(ext):
        lossfunc(model(X), y).backward()
    gram = torch.zeros(D_OUT, len(SUB), D_OUT, len(SUB), dtype=DT)
    for p, sl in param_slices(model):
        fns = p.vivit_ggn_exact
        v = torch.randn(3, *p.shape, dtype=DT)
        vt = fns["V_t_mat_prod"](v)
        assert vt.shape == (3, D_OUT, len(SUB))
        torch.testing.assert_close(vt[:, :, 0], vt[:, :, 1])  # the same sample twice
        torch.testing.assert_close(vt[:, :, 2], vt[:, :, 4])
        GGNv = fns["V_mat_prod"](vt)  # V_𝒮 V_𝒮ᵀ v
        torch.testing.assert_close(GGNv.flatten(1), v.flatten(1) @ ref[sl, sl])
        gram += fns["gram_mat"]()
    # the Gram matrix of the whole network: its non-zero eigenvalues are the GGN's
    evals = torch.linalg.eigvalsh(gram.reshape(D_OUT * len(SUB), -1))
    ref_evals = torch.linalg.eigvalsh(ref)
    k = torch.linalg.matrix_rank(ref).item()
    assert k <= D_OUT * 2  # two distinct samples
    torch.testing.assert_close(evals[-k:], ref_evals[-k:])
    torch.testing.assert_close(evals[:-k], torch.zeros_like(evals[:-k]), atol=1e-10, rtol=0)


def test_vivit_ggn_mc_repeated_subsampling_repeats_the_draw():
    """MC columns are drawn once per mini-batch sample: with the same seed, the sub-sampled
    factor is the full one's ``V[:, 𝒮]`` (a repeated index repeats the same draw)."""
    model, lossfunc, X, y = setup("ce")
    extend(model), extend(lossfunc)
    grams = []
    for sub in (None, SUB):
        torch.manual_seed(3)
        with backpack(ViViTGGNMC(mc_samples=4, subsampling=sub)):
            lossfunc(model(X), y).backward()
        grams.append([p.vivit_ggn_mc["gram_mat"]() for p in model.parameters()])
    idx = torch.tensor(SUB)
    for full, sub in zip(*grams):
        assert sub.shape == (4, len(SUB), 4, len(SUB))
        expected = full.index_select(1, idx).index_select(3, idx)
        torch.testing.assert_close(sub, expected, atol=1e-12, rtol=1e-12)


def test_vivit_computations_reject_repeated_indices():
    """As ViViT's ``check_subsampling_unique`` in its computations."""
    with pytest.raises(ValueError, match="unique"):
        EigvalshComputation(subsampling=[0, 0, 1])
