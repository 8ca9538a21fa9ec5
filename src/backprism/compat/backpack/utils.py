r"""BackPACK's ``backpack.utils``: ``convert_parameters``, ``examples`` (MNIST loaders and
autograd GGN references), ``kroneckers``, ``subsampling`` and ``module_classification``.

``examples.load_one_batch_mnist`` & co. need ``torchvision`` (and download MNIST to ``./data``
on first use, as BackPACK does); without it they raise an ``ImportError`` saying so.
``examples.autograd_diag_ggn_exact`` and ``_autograd_ggn_exact_columns`` compute GGN diagonal
entries / columns with GGN-vector products (:mod:`~backprism.compat.backpack.hessianfree`),
one unit vector at a time: references for small problems, not for speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from functools import reduce
from typing import Any

import torch
from torch import Tensor, nn

from backprism.compat._modules import alias_module
from backprism.compat.backpack.hessianfree import ggn_vector_product

__all__ = [
    "autograd_diag_ggn_exact",
    "get_mnist_dataloader",
    "kfacs_to_mat",
    "load_mnist_dataset",
    "load_one_batch_mnist",
    "vector_to_parameter_list",
]

__path__: list[str] = []


# -- convert_parameters -----------------------------------------------------------------------
def vector_to_parameter_list(vec: Tensor, parameters: Iterable[Tensor]) -> list[Tensor]:
    """Split the flat ``vec`` into tensors shaped like ``parameters`` (the inverse of
    ``torch.nn.utils.parameters_to_vector``; the parameters are left unchanged)."""
    if not isinstance(vec, Tensor):
        raise TypeError(f"expected Tensor, but got: {type(vec).__name__}")
    out, start = [], 0
    for p in parameters:
        n = p.numel()
        out.append(vec[start : start + n].view_as(p).data)
        start += n
    if start != vec.numel():
        raise ValueError(
            f"vector of {vec.numel()} entries does not match parameters with {start} entries"
        )
    return out


# -- examples -----------------------------------------------------------------------------------
def _torchvision() -> Any:
    try:
        import torchvision
    except ImportError as err:
        raise ImportError(
            "backprism.compat.backpack.utils.examples: the MNIST helpers need torchvision "
            "(pip install torchvision); they download MNIST to ./data like BackPACK's. For "
            "offline tests use random tensors of shape [N, 1, 28, 28] and labels in 0..9"
        ) from err
    return torchvision


def load_mnist_dataset() -> Any:
    """MNIST training set, normalised with mean 0.1307 and std 0.3081 (downloads to
    ``./data``)."""
    tv = _torchvision()
    transform = tv.transforms.Compose(
        [tv.transforms.ToTensor(), tv.transforms.Normalize((0.1307,), (0.3081,))]
    )
    return tv.datasets.MNIST(root="./data", train=True, transform=transform, download=True)


def get_mnist_dataloader(batch_size: int = 64, shuffle: bool = True) -> Any:
    """A ``DataLoader`` over :func:`load_mnist_dataset`."""
    return torch.utils.data.DataLoader(
        load_mnist_dataset(), batch_size=batch_size, shuffle=shuffle
    )


def load_one_batch_mnist(
    batch_size: int = 64, shuffle: bool = True, flat: bool = False
) -> tuple[Tensor, Tensor]:
    """One MNIST mini-batch ``(X, y)``; ``X`` is ``[N, 1, 28, 28]`` (``[N, 784]`` if ``flat``)."""
    X, y = next(iter(get_mnist_dataloader(batch_size, shuffle)))
    if flat:
        X = X.reshape(X.shape[0], -1)
    return X, y


def _autograd_ggn_exact_columns(
    X: Tensor,
    y: Tensor,
    model: nn.Module,
    loss_function: nn.Module,
    idx: Sequence[int] | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(d, G[:, d])`` for the exact GGN ``G`` of ``loss_function(model(X), y)`` over the
    trainable parameters (flattened and concatenated in ``model.parameters()`` order), for each
    ``d`` in ``idx`` (default: all)."""
    params = [p for p in model.parameters() if p.requires_grad]
    dim = sum(p.numel() for p in params)
    with torch.enable_grad():
        outputs = model(X)
        loss = loss_function(outputs, y)
    indices = range(dim) if idx is None else [int(i) for i in idx]
    for d in indices:
        e_d = torch.zeros(dim, device=X.device, dtype=outputs.dtype)
        e_d[d] = 1.0
        col = ggn_vector_product(loss, outputs, model, vector_to_parameter_list(e_d, params))
        yield d, torch.cat([c.reshape(-1) for c in col])


def autograd_diag_ggn_exact(
    X: Tensor,
    y: Tensor,
    model: nn.Module,
    loss_function: nn.Module,
    idx: Sequence[int] | None = None,
) -> Tensor:
    """Exact GGN diagonal (flattened and concatenated) computed with autograd; only the entries
    ``idx`` if given."""
    entries = [col[d] for d, col in _autograd_ggn_exact_columns(X, y, model, loss_function, idx)]
    return torch.stack(entries)


# -- kroneckers, subsampling, module classification ---------------------------------------------
def kfacs_to_mat(factors: Sequence[Tensor]) -> Tensor:
    """The Kronecker product ``F₁ ⊗ F₂ ⊗ …`` of a parameter's factors (e.g. ``param.kfac``)."""
    if not factors:
        raise ValueError("Got an empty list of factors")
    return reduce(torch.kron, list(factors))


def kfac_mat_prod(factors: Sequence[Tensor], mat: Tensor) -> Tensor:
    """``(F₁ ⊗ F₂ ⊗ …) mat`` for ``mat`` with as many rows as the product has columns."""
    return kfacs_to_mat(factors) @ mat


def get_batch_axis(module: nn.Module, io_str: str = "input0") -> int:
    """The batch axis of a module's input or output: 0 (backprism needs the batch first)."""
    return 0


def subsample(tensor: Tensor, dim: int = 0, subsampling: Sequence[int] | None = None) -> Tensor:
    """Select the ``subsampling`` entries of ``tensor`` along ``dim`` (all for ``None``)."""
    if subsampling is None:
        return tensor
    index = torch.as_tensor(list(subsampling), dtype=torch.long, device=tensor.device)
    return tensor.index_select(dim, index)


def is_loss(module: nn.Module) -> bool:
    """Whether ``module`` is a loss module."""
    return isinstance(module, nn.modules.loss._Loss)


def is_nll(module: nn.Module) -> bool:
    """Whether ``module`` is a loss BackPACK treats as a negative log-likelihood (and samples
    Monte-Carlo curvature from): ``MSELoss`` (Gaussian, ``σ² = 1/2``), ``CrossEntropyLoss``
    (categorical) and ``BCEWithLogitsLoss`` (Bernoulli).

    backprism's own Monte-Carlo columns cover more losses (``NLLLoss``, ``GaussianNLLLoss``);
    this predicate keeps BackPACK's answer so code branching on it behaves as with BackPACK.
    """
    return isinstance(module, (nn.MSELoss, nn.CrossEntropyLoss, nn.BCEWithLogitsLoss))


def is_no_op(module: nn.Module) -> bool:
    """Whether ``module`` is a container without an operation of its own."""
    return isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) or (
        type(module).forward is nn.Module.forward
    )


def is_nn(module: nn.Module) -> bool:
    """Whether ``module`` is an operation of a network (not a loss, not a container)."""
    return not is_loss(module) and not is_no_op(module)


alias_module(
    f"{__name__}.convert_parameters",
    "BackPACK's utils.convert_parameters.",
    vector_to_parameter_list=vector_to_parameter_list,
)
alias_module(
    f"{__name__}.examples",
    "BackPACK's utils.examples.",
    load_mnist_dataset=load_mnist_dataset,
    get_mnist_dataloader=get_mnist_dataloader,
    load_one_batch_mnist=load_one_batch_mnist,
    autograd_diag_ggn_exact=autograd_diag_ggn_exact,
    _autograd_ggn_exact_columns=_autograd_ggn_exact_columns,
)
alias_module(
    f"{__name__}.kroneckers",
    "BackPACK's utils.kroneckers (Kronecker factors to matrices).",
    kfacs_to_mat=kfacs_to_mat,
    kfac_mat_prod=kfac_mat_prod,
)
alias_module(
    f"{__name__}.subsampling",
    "BackPACK's utils.subsampling.",
    get_batch_axis=get_batch_axis,
    subsample=subsample,
)
alias_module(
    f"{__name__}.module_classification",
    "BackPACK's utils.module_classification.",
    is_loss=is_loss,
    is_nll=is_nll,
    is_no_op=is_no_op,
    is_nn=is_nn,
)
