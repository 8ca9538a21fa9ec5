"""The layer-rule interface and its registry.

A *rule* turns what the engine captured for one call of a parameter-owning module — its inputs
and the gradients (or backpropagated loss-Hessian square-root columns) with respect to its output
— into per-parameter quantities. Every method receives ``g`` with a leading *column* axis ``M``:

* first order: ``M = 1`` and ``g[0] = ∂L/∂out`` (already holding the loss's ``1/N`` for a mean
  reduction, so per-sample gradients follow the ``grad_batch[n] = ∇(ℓₙ/N)`` convention);
* second order: ``g[m] = (∂out/∂·)`` applied to column ``m`` of ``S/√N``, so that
  ``V[m, n] = Jₙᵀ g[m, n]`` are the columns of the GGN square root.

Only :meth:`Rule.per_sample` is mandatory. Every statistic has a default built from it; rules
override the statistics whose algebra avoids materialising ``[M, N, *param.shape]``.

Optional ``weights`` of shape ``[M, N]`` multiply each column's squared contribution; they carry
the signs of the Hessian residual terms used by ``DiagHessian``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from backprism.engine.state import Call, Inside

__all__ = [
    "KFAC_APPROXIMATIONS",
    "KRONECKER_DIAGONAL_MAX_BYTES",
    "KRONECKER_FACTOR_MAX_BYTES",
    "Call",
    "Outer",
    "Rule",
    "batch_first_args",
    "get_rule",
    "has_rule",
    "move_batch_axis",
    "moves_batch_axis",
    "params_of",
    "register_rule",
    "set_generic_rule",
    "with_approx",
]


_NOTHING_INSIDE = Inside()


@dataclass(frozen=True)
class Outer:
    r"""A call's per-sample, per-column gradients of one parameter as sums of outer products,

        ``Vₘₙ = Σₜ rₘₙₜ cₘₙₜᵀ``  (``[R, C]``, reshaped to the parameter's shape),

    which lets the engine combine the calls of a parameter used several times (tied weights)
    without building ``Vₘₙ`` (:mod:`backprism.engine.tied`).

    Attributes:
        rows: ``[M or 1, N, T, R]``; or, for one-hot rows (``e_{iₙₜ}``, an embedding's
            looked-up tokens), the integer indices ``iₙₜ`` ``[N, T]`` into the ``R`` rows.
        cols: ``[M or 1, N, T, C]``.
        size: ``R``, the number of rows (needed for one-hot rows).
    """

    rows: Tensor
    cols: Tensor
    size: int

    @property
    def one_hot(self) -> bool:
        return not self.rows.is_floating_point()


class Rule:
    """Per-module-type computations. Subclasses override what their algebra makes cheaper.

    All methods take ``call`` (the captured :class:`Call`) and ``g`` of shape ``[M, *out.shape]``
    (for multi-output modules, a tuple of such tensors), and return a dict from the module's own
    parameter names to tensors.
    """

    #: whether the module's output depends on its parameters linearly (needed by DiagHessian:
    #: a parameter entering nonlinearly has a Hessian term of its own).
    linear_in_params: bool = True
    #: the parameter ``W`` of a call ``y = x Wᵀ + b`` (a product over the input's last axis:
    #: Linear), or ``None``: where ``W`` also feeds ``x`` (tied weights, unrolled steps), the
    #: DiagHessian family builds the Hessian term of the product of its uses
    #: (:class:`~backprism.engine.residual.NestedSite`); other such calls are refused.
    product_weight: str | None = None
    #: whether every statistic is computed differentiably from the call's inputs and output
    #: gradients (no detached parameters, no in-place ops on saved tensors), so that a
    #: ``create_graph=True`` pass may hand it live inputs; others are refused in such a pass.
    differentiable: bool = False
    #: whether the rule acts on the trailing feature axes only, so that a call whose input has
    #: the batch on another axis (after a ``batch_first=False`` RNN) may be captured with that
    #: input moved batch-first (``Call.batch_axis``).
    moves_batch_axis: bool = False
    #: whether the rule computes a call on a folded batch itself (``Call.fold = k`` with
    #: ``batch_size`` the number of samples ``N`` and inputs of ``k·N`` rows, each sample's
    #: ``k`` rows together): modules whose forward may regroup those rows (Swin's masked
    #: window attention) need a sample's rows in one call. Other rules compute per row.
    folds_rows: bool = False

    def inside(self, module: nn.Module, args: tuple, kwargs: dict) -> Inside:
        """What the forward of this call of ``module`` should do inside it (called before the
        module's forward, only for rules that override it; decided once per call).

        A rule may *release* parameters whose uses inside the module are better attributed
        where they enter — e.g. attention's packed input projection, an ``F.linear`` whose
        output gradient the real backward pass computes anyway — and ask the forward to *keep*
        the input of the ``F.linear`` of a parameter it still claims, instead of recomputing
        it (:attr:`Call.inner`). The default releases and keeps nothing."""
        return _NOTHING_INSIDE

    def is_linear_in_params(self, call: Call) -> bool:
        """:attr:`linear_in_params` for one call (rules whose calls differ override it)."""
        return self.linear_in_params

    def is_affine_in_params(self, call: Call) -> bool:
        """Whether ``call``'s output is affine in each of its parameters (the rest held), its
        nonlinearity in its inputs, if any, left to the operations of its body — a weaker
        promise than :meth:`is_linear_in_params`, which the DiagHessian family accepts where
        the forward mode recorded every operation of the call's body (a hand-written RMSNorm
        ``x · rsqrt(mean(x²) + ε) · w``, ``F.layer_norm(x, s, self.w, self.b)``: their terms in
        the inputs are the sites of those operations). The default: :meth:`is_linear_in_params`."""
        return self.is_linear_in_params(call)

    def refusal(self, call: Call, n: int) -> str | None:
        """Why this rule cannot compute ``call`` in a pass of ``n`` samples, or ``None``;
        asked before anything is written (rules that find out only while computing say so
        here)."""
        return None

    def builds_per_sample(self, call: Call) -> bool:
        """Whether the statistics of ``call`` may build per-sample, per-column gradients
        ``[N, *p]`` (the engine sizes column chunks by it); rules with closed forms say no."""
        return True

    def per_sample(self, call: Call, g: Any) -> dict[str, Tensor]:
        """Per-sample, per-column parameter gradients ``Vₘₙ = Jₙᵀ g[m, n]``, ``[M, N, *p]``."""
        raise NotImplementedError

    def summed(self, call: Call, g: Any) -> dict[str, Tensor]:
        r"""Sum over samples ``Σₙ Vₘₙ``: ``[M, *p.shape]`` (for ``M = 1``, the gradient)."""
        return {k: v.sum(1) for k, v in self.per_sample(call, g).items()}

    def sum_squared(self, call: Call, g: Any, weights: Tensor | None = None) -> dict[str, Tensor]:
        r"""``Σₘ Σₙ wₘₙ Vₘₙ²``: ``[*p.shape]`` (SumGradSquared, DiagGGN)."""
        return {
            k: _weighted_square_sum(v, weights, (0, 1)) for k, v in self.per_sample(call, g).items()
        }

    def batch_sum_squared(
        self, call: Call, g: Any, weights: Tensor | None = None
    ) -> dict[str, Tensor]:
        r"""``Σₘ wₘₙ Vₘₙ²``: ``[N, *p.shape]`` (BatchDiagGGN)."""
        return {
            k: _weighted_square_sum(v, weights, (0,)) for k, v in self.per_sample(call, g).items()
        }

    def batch_l2(self, call: Call, g: Any) -> dict[str, Tensor]:
        r"""``Σₘ ‖Vₘₙ‖²``: ``[N]`` (BatchL2Grad)."""
        return {
            k: _flat_columns(v).square().sum((0, 2)) for k, v in self.per_sample(call, g).items()
        }

    def batch_dot(self, call: Call, g: Any) -> dict[str, Tensor]:
        r"""``Σₘ ⟨Vₘₙ, Vₘₙ'⟩``: ``[N, N]`` (BatchDotGrad)."""
        out = {}
        for k, v in self.per_sample(call, g).items():
            f = _flat_columns(v)
            out[k] = torch.einsum("mni,mki->nk", f, f)
        return out

    def batch_dot_with(self, call: Call, g: Any, vectors: dict[str, Tensor]) -> dict[str, Tensor]:
        r"""``Σₘ ⟨Vₘₙ, v⟩`` for given per-parameter ``vectors`` (``{name: [*p]}``): ``[N]`` per
        name in ``vectors`` (BatchDotWith, projections onto a direction)."""
        ps = self.per_sample(call, g)
        return {
            k: _flat_columns(ps[k]).sum(0) @ v.reshape(-1).to(ps[k].dtype)
            for k, v in vectors.items()
            if k in ps
        }

    def outer_factors(self, call: Call, g: Any) -> dict[str, Outer]:
        """The per-sample gradients of the parameters that have an outer-product form
        (:class:`Outer`), by name; a parameter left out is combined with its other calls
        through dense per-sample gradients when it is used several times. Default: none."""
        return {}

    # -- Kronecker factors (KFAC / KFLR / KFRA) ------------------------------------------------
    # ``approx`` names how a weight shared over the positions ``t`` of a call (a sequence's
    # tokens, a convolution's output pixels) is factored (Eschenhagen et al. 2023, "Kronecker-
    # Factored Approximate Curvature for Modern Neural Network Architectures"):
    #
    # * ``None`` (BackPACK's convention): ``A = (1/N) Σₙₜ xₙₜ xₙₜᵀ``, ``B = Σₘₙ ḡₘₙ ḡₘₙᵀ``
    #   with ``ḡₘₙ = Σₜ gₘₙₜ``;
    # * ``"expand"`` (every position a sample of its own): ``A = (1/(N·T)) Σₙₜ xₙₜ xₙₜᵀ``,
    #   ``B = Σₘₙₜ gₘₙₜ gₘₙₜᵀ``;
    # * ``"reduce"`` (positions aggregated first): ``A = (1/N) Σₙ x̄ₙ x̄ₙᵀ`` with
    #   ``x̄ₙ = (1/T) Σₜ xₙₜ``, ``B = Σₘₙ ḡₘₙ ḡₘₙᵀ``.
    #
    # With one position all three agree. Rules that know no ``approx`` are called without it
    # for BackPACK's convention and refused for the others (:func:`with_approx`).
    def kfac_input(self, call: Call, approx: str | None = None) -> dict[str, Tensor]:
        """Input-side Kronecker factor ``A`` per weight-like parameter (KFAC/KFLR/KFRA)."""
        raise NotImplementedError(
            f"backprism: {type(call.module).__name__}'s rule ({type(self).__name__}) defines no "
            "input-side Kronecker factor (kfac_input); Rule.kronecker_factors gives its "
            "parameters the single diagonal factor (kronecker_diagonal) instead"
        )

    def kfac_output(self, call: Call, g: Any, approx: str | None = None) -> dict[str, Tensor]:
        """Output-side Kronecker factor ``B = Σₘ Σₙ gₘₙ gₘₙᵀ`` per parameter (KFAC/KFLR)."""
        raise NotImplementedError(
            f"backprism: {type(call.module).__name__}'s rule ({type(self).__name__}) defines no "
            "output-side Kronecker factor (kfac_output); Rule.kronecker_factors gives its "
            "parameters the single diagonal factor (kronecker_diagonal) instead"
        )

    def kronecker_form(self, call: Call) -> bool:
        """Whether :meth:`kronecker_factors` gives ``call``'s parameters Kronecker factors
        (``[B, A]`` / ``[B]`` from :meth:`kfac_input` and :meth:`kfac_output`); ``False``: every
        parameter gets the single diagonal factor of :meth:`kronecker_diagonal`.

        By default, whether the rule's class defines ``kfac_input`` or ``kfac_output``: norm
        layers, the generic ``torch.func`` rule and other rules without them take the diagonal.
        Rules may decide per call (a layout without Kronecker structure)."""
        cls = type(self)
        return cls.kfac_input is not Rule.kfac_input or cls.kfac_output is not Rule.kfac_output

    def kronecker_factors(
        self, call: Call, g: Any, approx: str | None = None
    ) -> dict[str, list[Tensor]]:
        """Kronecker factors per parameter in BackPACK's order: ``[B, A]`` for a weight-like
        parameter (``B`` output side, ``A`` input side, so the block is ``≈ B ⊗ A``) and ``[B]``
        for a bias, in the convention ``approx`` (see above). Rules whose parameter axes
        differ (Embedding) override this. Without a Kronecker form (:meth:`kronecker_form`),
        the single diagonal factor of :meth:`kronecker_diagonal`."""
        if not self.kronecker_form(call):
            return self.kronecker_diagonal(call, g)
        a = with_approx(self.kfac_input, call, approx=approx)
        b = with_approx(self.kfac_output, call, g, approx=approx)
        return {k: [b[k], a[k]] if k in a else [b[k]] for k in b}

    def kronecker_diagonal(self, call: Call, g: Any) -> dict[str, list[Tensor]]:
        r"""The single-factor form of a parameter without Kronecker structure (elementwise
        parameters: norm scales and shifts, parameters of generic modules):

        .. math:: [D], \qquad D = \operatorname{diag}\Big(\sum_m \sum_n
            \operatorname{vec}(V_{mn})^{\odot 2}\Big) \quad [P, P],\ P = θ.\mathrm{numel}(),

        with ``Vₘₙ = Jₙᵀ gₘₙ`` (:meth:`per_sample`) and ``vec`` the row-major flattening — the
        diagonal of the GGN block ``Σₘₙ vec(Vₘₙ) vec(Vₘₙ)ᵀ`` that a bias's ``[B]`` holds in full,
        as a dense diagonal matrix in the bias's ``[B]`` format (a list with one ``[P, P]``
        factor). The scaling is that of ``g`` (``1/√N`` of a mean loss, ``1/√M`` of ``M`` MC
        columns), so ``D = diag(diag_ggn_exact)`` for exact columns and ``diag(diag_ggn_mc)``
        for MC ones. Refused when ``[P, P]`` would exceed :data:`KRONECKER_DIAGONAL_MAX_BYTES`."""
        for name, p in call.params.items():
            check_diagonal_size(p, call, name, f"its rule {type(self).__name__} has none")
        return {k: [torch.diag(v.reshape(-1))] for k, v in self.sum_squared(call, g).items()}

    def kronecker_sides(self, call: Call, name: str) -> tuple[int, ...]:
        """The sides of the square Kronecker factors of parameter ``name`` (an upper bound
        where they are block-diagonal), known before they are computed: by default
        ``(p.shape[0], p[0].numel())`` for a weight-like parameter (``[out, in]`` of a Linear,
        ``[V, D]`` of an Embedding, ``[C_out, C_in/G, *k]`` of a convolution) and
        ``(p.shape[0],)`` for a bias. Rules whose factors do not follow the weight's first
        axis (transpose convolutions) override this."""
        p = call.params[name]
        if p.dim() < 2:
            return (p.shape[0] if p.dim() else 1,)
        return (p.shape[0], p[0].numel())

    def kronecker_grad_side(self, call: Call, name: str, n_factors: int) -> list[bool]:
        """Which of :meth:`kronecker_factors`' factors depend on the backpropagated columns
        (summed over column chunks) rather than on the inputs only (computed once per call)."""
        return [True] + [False] * (n_factors - 1)


def check_diagonal_size(
    p: Tensor, call: Call, name: str | None = None,
    why: str = "one of its calls gives it none", label: Callable[[], str] | None = None,
) -> None:
    """Refuse a single diagonal Kronecker factor ``[P, P]`` of ``p`` (``P = p.numel()``) larger
    than :data:`KRONECKER_DIAGONAL_MAX_BYTES` (``label()``: the parameter's name in the model,
    e.g. ``"'blocks.0.norm.weight' of Net"``, asked only to refuse)."""
    size = p.numel() ** 2 * p.element_size()
    if size <= KRONECKER_DIAGONAL_MAX_BYTES:
        return
    module = type(call.module).__name__
    if label is not None:
        what = f"the parameter {label()}, used by a {module},"
    elif name:
        what = f"the parameter {name!r} of {module}"
    else:
        what = f"a parameter of {module}"
    raise NotImplementedError(
        f"backprism: {what} ({p.numel()} entries) has no Kronecker factors ({why}), so "
        f"KFAC/KFLR/KFRA would store its GGN diagonal as a [{p.numel()}, {p.numel()}] diagonal "
        f"matrix ({size / 2**30:.1f} GiB; the limit is "
        "backprism.engine.rule.KRONECKER_DIAGONAL_MAX_BYTES). Take its curvature from "
        "DiagGGNExact/DiagGGNMC (and freeze it with requires_grad_(False) for the Kronecker "
        f"pass), or register a Rule with kfac_input/kfac_output for {module}"
    )


def check_factor_sizes(
    rule: Rule, call: Call, name: str, extension: str, label: Callable[[], str] | None = None
) -> None:
    """Refuse Kronecker factors of ``call``'s parameter ``name`` larger than
    :data:`KRONECKER_FACTOR_MAX_BYTES` (:meth:`Rule.kronecker_sides`), before they are built
    (``label()``: the parameter's name in the model, asked only to refuse)."""
    p = call.params[name]
    for side in rule.kronecker_sides(call, name):
        size = side * side * p.element_size()
        if size <= KRONECKER_FACTOR_MAX_BYTES:
            continue
        module = type(call.module).__name__
        what = f"{label()}, used by a {module}" if label is not None else f"{name!r} of {module}"
        raise NotImplementedError(
            f"backprism: {extension} would store a [{side}, {side}] Kronecker factor "
            f"({size / 2**30:.1f} GiB) for the parameter {what}; the limit is "
            f"{KRONECKER_FACTOR_MAX_BYTES / 2**30:.1f} GiB "
            "(backprism.engine.rule.KRONECKER_FACTOR_MAX_BYTES). A factor over a vocabulary "
            "(an Embedding, a language model's output layer) is that large by definition. "
            "Freeze the parameter (requires_grad_(False)) for the Kronecker pass and take its "
            "curvature from DiagGGNMC/DiagGGNExact, or raise the limit if the memory is there"
        )


#: the conventions of :meth:`Rule.kronecker_factors` besides BackPACK's (``None``)
KFAC_APPROXIMATIONS = ("expand", "reduce")


def with_approx(method: Any, *args: Any, approx: str | None) -> Any:
    """``method(*args, approx=approx)``, or ``method(*args)`` for BackPACK's convention
    (``approx=None``), so that rules written without the argument keep working with it; such
    a rule is refused by name for the other conventions (its factors would be BackPACK's)."""
    if approx is None:
        return method(*args)
    target = inspect.unwrap(method)  # (through the engine's per-call memo)
    func = getattr(target, "__func__", target)
    takes = _TAKES_APPROX.get(func)
    if takes is None:
        takes = _TAKES_APPROX[func] = "approx" in inspect.signature(func).parameters
    if not takes:
        owner = getattr(target, "__self__", None)
        raise NotImplementedError(
            f"backprism: the rule {type(owner).__name__} computes its Kronecker factors "
            f"({getattr(func, '__name__', 'kfac')}) without an approx argument, so it has no "
            f"kfac_approx={approx!r} factors. Give its kfac_input/kfac_output (or "
            "kronecker_factors) an approx argument (engine/rule.py), or use kfac_approx=None"
        )
    return method(*args, approx=approx)


_TAKES_APPROX: dict[Any, bool] = {}


#: largest Kronecker factor (bytes) that KFAC/KFLR/KFRA build for a parameter with Kronecker
#: structure: a ``[V, V]`` factor of a vocabulary of ``V = 50 257`` tokens (GPT-2's embedding
#: and output layer) takes 9.4 GiB in float32
KRONECKER_FACTOR_MAX_BYTES = 2**31

#: largest single diagonal Kronecker factor ``[P, P]`` (bytes) that :meth:`Rule.kronecker_diagonal`
#: builds (a norm weight of 16384 entries in float64 takes 2 GiB)
KRONECKER_DIAGONAL_MAX_BYTES = 2**31


def _flat_columns(v: Tensor) -> Tensor:
    """``[M, N, *p.shape]`` as ``[M, N, P]`` with ``P = p.numel()`` (``P = 1`` for a 0-d
    parameter, whose per-sample tensor ``[M, N]`` has no axis for ``flatten(2)``)."""
    return v.reshape(*v.shape[:2], -1)


def _weighted_square_sum(v: Tensor, weights: Tensor | None, dims: tuple[int, ...]) -> Tensor:
    sq = v.square()
    if weights is not None:
        sq = sq * weights.reshape(weights.shape + (1,) * (v.dim() - 2))
    return sq.sum(dims)


_REGISTRY: dict[type[nn.Module], Rule] = {}
_GENERIC: list[Rule] = []


def register_rule(*module_types: type[nn.Module]):
    """Class decorator registering a :class:`Rule` for exact module types (no subclasses)."""

    def deco(cls: type[Rule]) -> type[Rule]:
        inst = cls()
        for t in module_types:
            _REGISTRY[t] = inst
        return cls

    return deco


def has_rule(module_type: type[nn.Module]) -> bool:
    """Whether a rule is registered for exactly ``module_type`` (the generic fallback aside)."""
    return module_type in _REGISTRY


def set_generic_rule(rule: Rule) -> None:
    """Install the fallback rule used for parameter-owning modules without a registered rule."""
    _GENERIC[:] = [rule]


def get_rule(module: nn.Module) -> Rule:
    """The rule for ``module``: registered by exact type (a layer with parametrized weights,
    whose class ``torch.nn.utils.parametrize`` replaced by a subclass adding the parametrized
    properties, by its original class), else the generic ``torch.func`` rule."""
    rule = _REGISTRY.get(type(module))
    if rule is not None:
        return rule
    rule = _REGISTRY.get(parametrize.type_before_parametrizations(module))
    if rule is not None:
        return rule
    if not _GENERIC:  # backprism.rules installs it; a bare engine has no fallback
        raise NotImplementedError(f"no rule for {type(module).__name__}")
    return _GENERIC[0]


def moves_batch_axis(module: nn.Module, first: Tensor, axis: int) -> bool:
    """Whether ``module``'s rule computes from inputs whose batch is moved to axis 0 (it acts on
    the trailing feature axes only, :attr:`Rule.moves_batch_axis`), and ``axis`` of its first
    input ``first`` is not one of those."""
    if first.dim() <= axis or not get_rule(module).moves_batch_axis:
        return False
    shape = getattr(module, "normalized_shape", None)  # LayerNorm, RMSNorm
    trailing = len(shape) if isinstance(shape, (tuple, list)) else 1
    return first.is_floating_point() is False or axis < first.dim() - trailing


def batch_first_args(args: tuple, axis: int) -> tuple:
    """``args`` with the first (the batch-carrying input) moved from ``axis`` to axis 0."""
    return (args[0].movedim(axis, 0), *args[1:])


def move_batch_axis(call: Call, axis: int) -> bool:
    """Have ``call``, recorded with the batch on axis 0 of its first input, take the batch from
    ``axis`` instead: ``args`` (and ``live``) keep that input with the batch moved to axis 0,
    and ``batch_axis`` tells the engine to move the output gradients' the same way. ``False``
    (nothing changed) where the call's rule cannot (:func:`moves_batch_axis`)."""
    arg = call.args[0] if call.args else None
    if not isinstance(arg, Tensor) or not moves_batch_axis(call.module, arg, axis):
        return False
    call.args = batch_first_args(call.args, axis)
    if call.live is not None:
        call.live = (batch_first_args(call.live[0], axis), call.live[1])
    call.batch_size, call.batch_axis, call.assumed_axis = arg.shape[axis], axis, False
    return True


def params_of(call: Call) -> dict[str, nn.Parameter]:
    """The trainable parameters a call is responsible for (see :attr:`Call.params`)."""
    return call.params
