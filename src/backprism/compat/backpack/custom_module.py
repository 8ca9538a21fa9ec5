r"""BackPACK's ``backpack.custom_module``: the utility modules and the graph converter.

BackPACK needs these modules to express residual connections, tuple outputs, permutations and
slicing as a sequence of modules it can backpropagate through. backprism lets autograd handle
all of that, so here they are plain ``nn.Module``\ s with BackPACK's constructors and forwards
(usable in models, extended or not), and the graph conversion is a no-op:

=====================================================  =========================================
``branching.SumModule()``                              sums its inputs (same shapes required)
``branching.Parallel(*mods, merge_module=None)``       feeds the input to each module, merges
                                                       (default: ``SumModule``)
``branching._Branch(*mods)``                           tuple of each module's output
``scale_module.ScaleModule(weight: float = 1.0)``      ``input * weight`` (a float, no parameter)
``pad.Pad(pad, mode="constant", value=0.0)``           ``torch.nn.functional.pad``
``permute.Permute(*dims, init_transpose=False)``       ``permute(*dims)`` (``transpose`` if
                                                       ``init_transpose``)
``reduce_tuple.ReduceTuple(index=0)``                  ``input[index]``
``slicing.Slicing(slice_info)``                        ``input[slice_info]``
``graph_utils.convert_module_to_backpack(m, debug)``   returns ``m`` unchanged
``graph_utils.BackpackTracer``                         ``torch.fx`` tracer keeping these modules
                                                       as leaves
=====================================================  =========================================
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn
from torch.nn import functional as F

from backprism.compat._modules import alias_module

__all__ = [
    "BackpackTracer",
    "Pad",
    "Parallel",
    "Permute",
    "ReduceTuple",
    "ScaleModule",
    "Slicing",
    "SumModule",
    "convert_module_to_backpack",
]

__path__: list[str] = []


class ScaleModule(nn.Module):
    """Scales the input by a constant float ``weight`` (not a parameter)."""

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        if not isinstance(weight, float):
            raise ValueError("Weight must be float.")
        self.weight: float = weight

    def forward(self, input: Tensor) -> Tensor:
        return input * self.weight


class SumModule(nn.Module):
    """Sums its inputs (a tuple of tensors of one shape)."""

    def forward(self, *input: Tensor) -> Tensor:
        if not isinstance(input, tuple):
            raise AssertionError(f"Expecting tuple as input. Got {input.__class__}")
        if not all(isinstance(inp, Tensor) for inp in input):
            raise AssertionError(
                f"Expecting tuple of tensors, but received ({[i.__class__ for i in input]})"
            )
        if not all(inp.shape == input[0].shape for inp in input):
            raise AssertionError(f"Shapes don't match: {[inp.shape for inp in input]}.")
        return sum(input[1:], input[0])


def _children(args: tuple) -> OrderedDict[str, nn.Module]:
    if len(args) == 1 and isinstance(args[0], OrderedDict):
        return OrderedDict(args[0])
    return OrderedDict((str(i), m) for i, m in enumerate(args))


class _Branch(nn.Module):
    """Feeds the input to each child (``nn.Sequential``'s interface) and returns the tuple of
    their outputs."""

    def __init__(self, *args: OrderedDict[str, nn.Module] | nn.Module) -> None:
        super().__init__()
        for name, module in _children(args).items():
            self.add_module(name, module)

    def forward(self, input: Tensor) -> tuple[Any, ...]:
        return tuple(module(input) for module in self.children())


class Parallel(nn.Module):
    """Feeds the input to each child and merges the outputs with ``merge_module`` (default
    :class:`SumModule`)."""

    def __init__(
        self,
        *args: OrderedDict[str, nn.Module] | nn.Module,
        merge_module: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.branch = _Branch(*args)
        self.merge = SumModule() if merge_module is None else merge_module

    def forward(self, input: Tensor) -> Tensor:
        return self.merge(*self.branch(input))


class Pad(nn.Module):
    """``torch.nn.functional.pad(input, pad, mode, value)`` as a module."""

    def __init__(self, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> None:
        super().__init__()
        self.pad = pad
        self.mode = mode
        self.value = value

    def forward(self, input: Tensor) -> Tensor:
        return F.pad(input, self.pad, mode=self.mode, value=self.value)


class Permute(nn.Module):
    """Permutes the input's axes (``dims``), or, with ``init_transpose=True``, transposes the
    two axes given in ``dims``."""

    def __init__(self, *dims: Any, init_transpose: bool = False) -> None:
        super().__init__()
        self.dims = dims
        self.init_transpose = init_transpose
        if init_transpose and len(dims) != 2:
            raise ValueError(f"transpose takes two axes, got {dims}")

    def forward(self, input: Tensor) -> Tensor:
        if self.init_transpose:
            return input.transpose(*self.dims)
        return input.permute(*self.dims)


class ReduceTuple(nn.Module):
    """Selects element ``index`` of a tuple input (e.g. the output of an LSTM)."""

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        self.index = index

    def forward(self, input: tuple) -> Any:
        return input[self.index]


class Slicing(nn.Module):
    """``input[slice_info]`` as a module."""

    def __init__(self, slice_info: Any) -> None:
        super().__init__()
        self.slice_info = slice_info

    def forward(self, input: Tensor) -> Tensor:
        return input[self.slice_info]


_CUSTOM = (ScaleModule, SumModule, _Branch, Parallel, Pad, Permute, ReduceTuple, Slicing)


class BackpackTracer(torch.fx.Tracer):
    """``torch.fx`` tracer that keeps BackPACK's custom modules as leaf modules."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, _CUSTOM):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def convert_module_to_backpack(module: nn.Module, debug: bool = False) -> nn.Module:
    """BackPACK's graph conversion (``x * c`` → ScaleModule, ``+`` → SumModule, ...): not needed,
    since backprism handles residual connections, functional code and in-place operations
    through autograd; returns ``module`` unchanged."""
    if debug:
        print(
            f"[DEBUG] convert_module_to_backpack: {type(module).__name__} needs no conversion "
            "in backprism (autograd handles the graph)"
        )
    return module


alias_module(
    f"{__name__}.branching",
    "BackPACK's custom_module.branching.",
    SumModule=SumModule,
    Parallel=Parallel,
    _Branch=_Branch,
)
alias_module(
    f"{__name__}.graph_utils",
    "BackPACK's custom_module.graph_utils.",
    BackpackTracer=BackpackTracer,
    convert_module_to_backpack=convert_module_to_backpack,
)
alias_module(f"{__name__}.scale_module", "ScaleModule.", ScaleModule=ScaleModule)
alias_module(f"{__name__}.pad", "Pad.", Pad=Pad)
alias_module(f"{__name__}.permute", "Permute.", Permute=Permute)
alias_module(f"{__name__}.reduce_tuple", "ReduceTuple.", ReduceTuple=ReduceTuple)
alias_module(f"{__name__}.slicing", "Slicing.", Slicing=Slicing)
