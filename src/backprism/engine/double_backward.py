"""Clear errors for Hessian-vector products through ops that have no double backward.

Hessian-vector products (``HutchinsonDiagHessian``, the monitor's ``HessMaxEV``) differentiate
the backward graph a second time. Some fused kernels implement only a first derivative, most
prominently the fused scaled-dot-product attention kernels that ``nn.MultiheadAttention`` and
``F.scaled_dot_product_attention`` pick on the CPU; PyTorch then raises
``derivative for aten::…_backward is not implemented``. The fix is on the user's side: run the
*forward* pass with the math attention kernel, which is twice differentiable. Regions compiled
by ``torch.compile`` have no double backward at all: the fix is an uncompiled forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["explain_double_backward"]


@contextmanager
def explain_double_backward(what: str) -> Iterator[None]:
    """Re-raise PyTorch's "derivative for … is not implemented" with the way out."""
    try:
        yield
    except RuntimeError as err:
        msg = str(err)
        if "does not currently support double backward" in msg:  # a torch.compile'd region
            raise RuntimeError(
                f"{what} needs Hessian-vector products (a second backward through the graph), "
                "but the forward pass ran through torch.compile, whose compiled regions "
                "(AOTAutograd) have no second derivative. Run the forward pass of the steps "
                "that compute it with the uncompiled model (`compiled._orig_mod`, the model "
                "torch.compile wrapped)"
            ) from err
        if "derivative for" not in msg or "not implemented" not in msg:
            raise
        op = msg.split("derivative for", 1)[1].split("is not implemented", 1)[0].strip()
        hint = (
            "; for attention run the forward pass under "
            "`with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):` "
            "(the math kernel is twice differentiable)"
            if "attention" in op
            else "; replace that op by a twice-differentiable one in the forward pass"
        )
        raise RuntimeError(
            f"{what} needs Hessian-vector products (a second backward through the graph), but "
            f"PyTorch implements no second derivative for {op}{hint}"
        ) from err
