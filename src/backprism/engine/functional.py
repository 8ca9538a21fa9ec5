r"""Parameters used outside the forward of the module that owns them, attributed as calls.

During every top-level forward of an extended model a :class:`~torch.overrides.TorchFunctionMode`
(:class:`ForwardMode`) sees each operation. When an operand is an extended parameter — or a view
of one (``w.T``, ``w.view(...)``, ``w[None]``, ``w.to(dtype)``) — and no hooked module that owns
the parameter is in its forward right now, the operation is a *functional use*: a decoder's
logits ``h @ self.emb.weight.T`` (tied embeddings), ``F.linear(x, self.w)`` in a container's
forward, ``x * self.gamma + self.beta`` in a hand-written norm. Each such operation becomes a
:class:`~backprism.engine.state.Call` of a stand-in module, captured exactly like a module call,
so every extension and the spectral computations see it and combine it with the parameter's
other uses (tying):

* ``F.linear(x, w, b)`` and ``x @ w.T`` (``matmul``/``mm``/``@`` with a transposed 2-d
  parameter) → an ``nn.Linear`` stand-in: the Linear closed forms
  (``‖gₙ‖² = ‖δₙ‖²‖xₙ‖²``, Gram form for sequences, Kronecker factors);
* any other operation → an :class:`OpModule` stand-in whose forward re-runs the operation with
  the parameter operands rebuilt from its parameters; the generic ``torch.func`` rule computes
  per-sample gradients ``(∂op(θ, xₙ)/∂θ)ᵀ gₙ`` from it. Its tensors that are not parameter
  views are the per-sample inputs (batch axis first, as for modules).

Views of parameters are tracked on the view tensor (``_backprism_view``: the parameter and the
function that rebuilds the view from it). An operation whose tensor operands are all parameter
views has no batch axis and is not attributed; the graph check
(:mod:`backprism.engine.graph`) then refuses the backward pass with the parameter's name.

The same mode records nonlinearities for the DiagHessian family
(:func:`backprism.engine.residual.record`) when that is wanted, so one Python dispatch per
operation serves both.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

try:
    from torch.nn.attention import SDPBackend as _SDPBackend
    from torch.nn.attention import sdpa_kernel as _sdpa_kernel
except ImportError:  # pragma: no cover - torch < 2.3
    _SDPBackend = _sdpa_kernel = None

from backprism.engine import forward as _forward
from backprism.engine import residual
from backprism.engine.attention import sdpa_arguments
from backprism.engine.broadcast import (
    DROPOUT,
    EXPANDS,
    MEETS,
    ParamBroadcast,
    after_operation,
    before_in_place,
    broadcast_calls,
    broadcast_param,
    dropout_mask,
    with_attn_mask,
)
from backprism.engine.forward import capture, keep_linear, releasing_frame
from backprism.engine.state import (
    AXIS,
    ESCAPED,
    FORWARD,
    FORWARD_LISTENERS,
    FREE,
    MODE_FREE,
    SHARED,
    UNATTRIBUTED,
    VIEW,
    active,
    param_view,
)

__all__ = ["ForwardMode", "OpModule", "ParamBroadcast", "ReleaseMode"]

_VIEW_OPS = frozenset(
    {
        "t", "T", "mT", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze",
        "expand", "expand_as", "flatten", "unflatten", "view_as", "reshape_as", "__getitem__",
        "to", "type", "float", "double", "half", "bfloat16", "contiguous", "clone",
    }
)
#: attribute of a tensor that a transpose inside a releasing forward made (:func:`_mark_transposed`)
_MOVED = "_backprism_transposed"
_TRANSPOSES = frozenset({"t", "T", "mT", "transpose"})
_MATMULS = frozenset({"matmul", "__matmul__", "mm"})
#: module → (the ids of its sub-modules' parameters when the table was built, the table); no
#: module is held (the weak key must not be kept alive by its own value)
_OWNERS: weakref.WeakKeyDictionary[
    nn.Module, tuple[tuple[int, ...], dict[int, frozenset[int]]]
] = weakref.WeakKeyDictionary()


def _owners(module: nn.Module) -> dict[int, frozenset[int]]:
    """Parameter id → ids of the sub-modules of ``module`` (itself included) owning it
    directly. Cached per module and checked against the parameters the sub-modules hold now:
    ``torch.func.functional_call`` swaps other tensors into ``_parameters`` for one call, and
    a table built then would disown the module's own parameters in its later calls."""
    subs = list(module.modules()) if module._modules else [module]
    key = tuple(id(p) for sub in subs for p in sub._parameters.values())
    entry = _OWNERS.get(module)
    if entry is not None and entry[0] == key:
        return entry[1]
    found: dict[int, set[int]] = {}
    for sub in subs:
        for p in sub._parameters.values():
            if p is not None:
                found.setdefault(id(p), set()).add(id(sub))
    table = {pid: frozenset(owners) for pid, owners in found.items()}
    _OWNERS[module] = (key, table)
    return table


def _is_owned(p: nn.Parameter) -> bool:
    """Whether a hooked module in its forward right now will claim ``p`` for its call: ``p``
    is its own, or belongs to a descendant that has not run during the call (the engine's
    :func:`~backprism.engine.forward.call_params`)."""
    pid = id(p)
    stack = FORWARD.call_stack
    if not stack:
        return False
    top = stack[-1]
    if top[6] and not top[2] and pid in _owners(top[0]):
        return True  # the common case: a leaf module (Linear, Conv, a norm) using its own
    if any(frame[2] and pid in frame[2] for frame in stack):
        return False  # released by a call to be attributed where it enters (Inside.release)
    for frame in reversed(stack):  # innermost first: the root's table is the largest
        module, ran = frame[0], frame[1]
        subs = _owners(module).get(pid)
        if subs is not None and (id(module) in subs or not subs <= ran):
            if frame[2] and frame[8] is not None and id(module) not in subs:
                # a sub-module's parameter used in the forward of a module that releases its
                # own (timm's F.linear(x, self.qkv.weight, qkv_bias) beside its q_bias): it is
                # released too, so that the use is attributed where it enters, not by a vmap
                # of the whole module (undone with the rest, :func:`forward.undo_release`)
                frame[2] = frame[2] | {pid}
                return False
            return True
    return False


class OpModule(nn.Module):
    """Stand-in module for one functional use: re-runs ``func`` with the parameter operands
    rebuilt from its own parameters (``p0``, ``p1``, …) and the per-sample tensors passed to
    :meth:`forward` in order."""

    def __init__(
        self, func: Any, template: list[Any], kwargs: dict, params: list,
        linear_in_params: bool = False,
    ) -> None:
        super().__init__()
        self._func = func
        self._template = template  # ("p", index, rebuild) | ("x", position) | constant
        self._kwargs = kwargs  # name → ("p", index, rebuild) | constant
        for i, p in enumerate(params):
            self._parameters[f"p{i}"] = p
        #: the operation's name (``"mul"``, ``"__add__"``): rules with closed forms for some
        #: operations look it up (:mod:`backprism.rules.elementwise`)
        self.op = residual.op_name(func)
        self._backprism_name = f"'{self.op}' (a functional use of a parameter)"
        #: whether the output depends linearly on the parameters (DiagHessian): the operation
        #: is affine in its operands, or multilinear with the parameters in one operand, and
        #: every parameter operand is a view of its parameter (:func:`_linear_use`)
        self.linear_in_params = linear_in_params
        #: an elementwise, indexing or joining operation: the generic rule's per-sample vmap
        #: of it does the arithmetic a closed form would (``Σ_broadcast gₙ ⊙ xₙ`` for a scale),
        #: so the rule does not announce it as a costly fallback
        self.vmap_is_closed_form = self.op in _ELEMENTWISE_OPS

    def _value(self, item: Any, xs: tuple[Tensor, ...]) -> Any:
        if isinstance(item, tuple) and item and item[0] == "p":
            return item[2](self._parameters[f"p{item[1]}"])
        if isinstance(item, tuple) and item and item[0] == "x":
            return xs[item[1]]
        return item[1] if isinstance(item, tuple) and item and item[0] == "c" else item

    def forward(self, *xs: Tensor) -> Any:
        args = [self._value(item, xs) for item in self._template]
        kwargs = {k: self._value(v, xs) for k, v in self._kwargs.items()}
        return self._func(*args, **kwargs)


#: root model → ``{key: (stand-in, its parameters)}``: a functional use of the same parameters
#: with the same options (a tied head, a released attention projection, a norm subclass's
#: ``F.layer_norm``, a functional convolution) reuses its stand-in in every forward instead of
#: building a module each time — one module fewer to build, and to keep alive until the
#: backward, per use and forward. The parameters are checked by identity (and shape, which
#: ``p.data = ...`` may change); entries go with the model, and past
#: :data:`_STAND_INS_PER_ROOT` those whose parameters the model no longer holds are dropped
_STAND_INS_PER_ROOT = 512
_STAND_INS: weakref.WeakKeyDictionary[
    nn.Module, dict[tuple, tuple[nn.Module, tuple[nn.Parameter | None, ...]]]
] = weakref.WeakKeyDictionary()


def _stand_in(
    key: tuple | None, params: tuple[nn.Parameter | None, ...], build: Callable[[], nn.Module]
) -> nn.Module:
    """The root model's stand-in for ``key`` (the operation and its options, hashable, or
    ``None``: not cached) on ``params``, built by ``build`` where there is none yet."""
    root = FORWARD.root_stack[0] if FORWARD.root_stack else None
    if root is None or key is None:
        return build()
    cache = _STAND_INS.get(root)
    if cache is None:
        cache = _STAND_INS[root] = {}
    full = (*key, *((id(p), tuple(p.shape)) if p is not None else None for p in params))
    entry = cache.get(full)
    if entry is not None and all(a is b for a, b in zip(entry[1], params)):
        return entry[0]
    if len(cache) >= _STAND_INS_PER_ROOT:  # parameters replaced: drop what they left behind
        held = {id(q) for q in root.parameters()} | {id(None)}
        for k in [k for k, (_, ps) in cache.items() if not {id(q) for q in ps} <= held]:
            del cache[k]
        if len(cache) >= _STAND_INS_PER_ROOT // 2:
            cache.clear()
    m = build()
    cache[full] = (m, params)
    return m


def _option(v: Any) -> Any:
    """``v`` (an operation's option: a number, a string, a tuple of them) as a hashable key
    that tells apart values Python takes as equal (``1``, ``1.0``, ``True``); ``None`` for an
    option that is no such value."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return (type(v), v)
    if isinstance(v, (tuple, list)):
        items = tuple(_option(a) for a in v)
        return None if None in items else (tuple, items)
    return None


def _options(*values: Any) -> tuple | None:
    keys = tuple(_option(v) for v in values)
    return None if None in keys else keys


def _linear_stand_in(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    return _stand_in(  # type: ignore[return-value]
        ("linear",), (weight, bias), lambda: _new_linear_stand_in(weight, bias)
    )


def _new_linear_stand_in(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    m = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(m)
    m.in_features, m.out_features = weight.shape[1], weight.shape[0]
    m._parameters["weight"] = weight
    m._parameters["bias"] = bias
    m._backprism_name = "linear (a functional use of a parameter)"  # type: ignore[attr-defined]
    return m


def _embedding_stand_in(weight: nn.Parameter, kwargs: dict, rest: tuple) -> nn.Embedding:
    names = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    opts = dict(zip(names, rest)) | {k: v for k, v in kwargs.items() if k in names}
    key = _options(*(opts.get(k) for k in names))
    return _stand_in(  # type: ignore[return-value]
        None if key is None else ("embedding", key), (weight,),
        lambda: _new_embedding_stand_in(weight, opts),
    )


def _new_embedding_stand_in(weight: nn.Parameter, opts: dict) -> nn.Embedding:
    m = nn.Embedding.__new__(nn.Embedding)
    nn.Module.__init__(m)
    m.num_embeddings, m.embedding_dim = weight.shape
    pad = opts.get("padding_idx")
    m.padding_idx = pad + weight.shape[0] if pad is not None and pad < 0 else pad
    m.max_norm = opts.get("max_norm")
    m.norm_type = opts.get("norm_type", 2.0)
    m.scale_grad_by_freq = bool(opts.get("scale_grad_by_freq", False))
    m.sparse = bool(opts.get("sparse", False))
    m._parameters["weight"] = weight
    m._backprism_name = "embedding (a functional use of a parameter)"  # type: ignore[attr-defined]
    return m


def _norm_stand_in(
    name: str, weight: nn.Parameter | None, bias: nn.Parameter | None, args: list
) -> nn.Module:
    """``F.layer_norm(x, shape, w, b, eps)``, ``F.group_norm(x, groups, w, b, eps)`` or
    ``F.rms_norm(x, shape, w, eps)`` (``args`` positional, defaults filled) as the module whose
    closed-form rule (``y = x̂ ⊙ w + b``, :mod:`backprism.rules.norm`) attributes it."""
    eps = args[3] if name == "rms_norm" else args[4]
    shape = (int(args[1]), args[0].shape[1]) if name == "group_norm" else args[1]
    key = _options(shape, eps)
    return _stand_in(
        None if key is None else (name, key), (weight, bias),
        lambda: _new_norm_stand_in(name, weight, bias, args),
    )


def _new_norm_stand_in(
    name: str, weight: nn.Parameter | None, bias: nn.Parameter | None, args: list
) -> nn.Module:
    cls = {"layer_norm": nn.LayerNorm, "group_norm": nn.GroupNorm, "rms_norm": nn.RMSNorm}[name]
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    if name == "group_norm":
        m.num_groups, m.num_channels, m.affine = int(args[1]), args[0].shape[1], True
    else:
        shape = args[1]
        m.normalized_shape = (shape,) if isinstance(shape, int) else tuple(shape)
        m.elementwise_affine = True
    m.eps = args[3] if name == "rms_norm" else args[4]
    m._parameters["weight"] = weight
    m._parameters["bias"] = bias
    m._backprism_name = f"{name} (a functional use of a parameter)"
    return m


#: ``F.batch_norm``'s and ``F.instance_norm``'s arguments in order, their defaults and their
#: modules by input dimension (``torch.batch_norm``, also named ``batch_norm``, orders them
#: differently: only the ``F`` functions themselves are taken). Argument 5 is ``training`` /
#: ``use_input_stats``: whether the input's own statistics are used.
_STAT_NORMS: dict[str, tuple[Any, tuple[str, ...], tuple[Any, ...], dict[int, type]]] = {
    "batch_norm": (
        F.batch_norm,
        ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
        (None, None, None, None, None, False, 0.1, 1e-5),
        {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d},
    ),
    "instance_norm": (
        F.instance_norm,
        (
            "input", "running_mean", "running_var", "weight", "bias", "use_input_stats",
            "momentum", "eps",
        ),
        (None, None, None, None, None, True, 0.1, 1e-5),
        {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d},
    ),
}


def _stat_norm(
    name: str, func: Any, args: tuple, kwargs: dict, x: Tensor, outs: list[Tensor],
    owned: frozenset[int],
) -> bool:
    """Capture ``F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum,
    eps)`` with parameter ``weight``/``bias`` (timm's ``BatchNormAct2d``, any BatchNorm
    subclass with a forward of its own, released by the generic rule in eval mode) as a call
    of a BatchNorm stand-in with the same running statistics, ``eps`` and mode: the BatchNorm
    rule's closed form ``y = x̂ ⊙ w + b`` with ``x̂`` from the running statistics, and the
    engine's refusal of batch statistics (``training=True``, or no running statistics: they
    mix the samples) as for ``nn.BatchNorm2d``. ``F.instance_norm`` (same arguments,
    ``use_input_stats`` for ``training``) likewise as an InstanceNorm stand-in: per-sample
    statistics, or the running ones. Returns whether the use was captured (other arguments:
    the generic stand-in)."""
    target, arg_names, defaults, classes = _STAT_NORMS[name]
    if func is not target or len(args) > len(arg_names):
        return False
    if not set(kwargs) <= set(arg_names[len(args) :]):
        return False
    full = list(args) + [
        kwargs.get(k, d) for k, d in zip(arg_names[len(args) :], defaults[len(args) :])
    ]
    if full[0] is not x or x.dim() not in classes or not isinstance(full[5], bool):
        return False
    found: dict[str, nn.Parameter] = {}
    for key, a in (("weight", full[3]), ("bias", full[4])):
        v = _pv(a, owned) if a is not None else None
        if v is not None and v[2] == "param" and v[0].dim() == 1:
            found[key] = v[0]
        elif not (a is None or _frozen(a, owned)):
            return False
    stats = full[1:3]
    if not found or any(s is not None and not isinstance(s, Tensor) for s in stats):
        return False
    eps = full[7]
    key = _options(x.dim(), eps)
    weight, bias = found.get("weight"), found.get("bias")
    cls = classes[x.dim()]
    module = _stand_in(
        None if key is None else (name, key, *(id(s) for s in stats)),
        (weight, bias),
        lambda: _new_stat_norm_stand_in(name, cls, weight, bias, stats, eps),
    )
    if module.running_mean is not stats[0] or module.running_var is not stats[1]:
        module = _new_stat_norm_stand_in(name, cls, weight, bias, stats, eps)  # (ids reused)
    module.training = full[5]
    _capture_one(module, x, outs, found)
    return True


def _new_stat_norm_stand_in(
    name: str, cls: type, weight: nn.Parameter | None, bias: nn.Parameter | None,
    stats: list, eps: Any,
) -> nn.Module:
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    m.num_features = (weight if weight is not None else bias).shape[0]  # type: ignore[union-attr]
    m.eps, m.momentum, m.affine = eps, 0.0, True
    m.track_running_stats = stats[0] is not None
    m._parameters["weight"] = weight
    m._parameters["bias"] = bias
    m._buffers["running_mean"], m._buffers["running_var"] = stats[0], stats[1]
    m._buffers["num_batches_tracked"] = None
    m._backprism_name = f"{name} (a functional use of a parameter)"  # type: ignore[attr-defined]
    return m


#: positional order and defaults of the functions attributed in closed form, so that
#: parameters passed by keyword (``F.layer_norm(x, s, weight=self.weight, bias=self.bias)``)
#: are seen where the closed forms look for them
_CONV_SIGNATURE = (
    ("input", None), ("weight", None), ("bias", None), ("stride", 1), ("padding", 0),
    ("dilation", 1), ("groups", 1),
)
_SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "linear": (("input", None), ("weight", None), ("bias", None)),
    "layer_norm": (
        ("input", None), ("normalized_shape", None), ("weight", None), ("bias", None),
        ("eps", 1e-5),
    ),
    "group_norm": (
        ("input", None), ("num_groups", None), ("weight", None), ("bias", None), ("eps", 1e-5),
    ),
    "rms_norm": (("input", None), ("normalized_shape", None), ("weight", None), ("eps", None)),
    "embedding": (
        ("input", None), ("weight", None), ("padding_idx", None), ("max_norm", None),
        ("norm_type", 2.0), ("scale_grad_by_freq", False), ("sparse", False),
    ),
    "conv1d": _CONV_SIGNATURE,
    "conv2d": _CONV_SIGNATURE,
    "conv3d": _CONV_SIGNATURE,
}
_NORMS = frozenset({"layer_norm", "group_norm", "rms_norm"})


def _positional(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` with ``kwargs`` of a function in :data:`_SIGNATURES` moved into their
    positions (defaults filled up to the last one given); other calls unchanged."""
    sig = _SIGNATURES.get(name)
    if sig is None:
        return args, kwargs
    names = [k for k, _ in sig]
    if not kwargs or not set(kwargs) <= set(names[len(args):]):
        return args, kwargs
    last = max(names.index(k) for k in kwargs)
    full = list(args) + [kwargs.get(k, d) for k, d in sig[len(args) : last + 1]]
    return tuple(full), {}


_CONV_TYPES = {"conv1d": nn.Conv1d, "conv2d": nn.Conv2d, "conv3d": nn.Conv3d}


def _conv_stand_in(
    kind: str, weight: nn.Parameter, bias: nn.Parameter | None, kwargs: dict, rest: tuple
) -> nn.Module:
    names = ("stride", "padding", "dilation", "groups")
    opts = dict(zip(names, rest)) | {k: v for k, v in kwargs.items() if k in names}
    key = _options(*(opts.get(k) for k in names))
    return _stand_in(
        None if key is None else (kind, key), (weight, bias),
        lambda: _new_conv_stand_in(kind, weight, bias, opts),
    )


def _new_conv_stand_in(
    kind: str, weight: nn.Parameter, bias: nn.Parameter | None, opts: dict
) -> nn.Module:
    cls = _CONV_TYPES[kind]
    d = int(kind[-2])

    def tup(v: Any) -> tuple:
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * d

    m = cls.__new__(cls)
    nn.Module.__init__(m)
    groups = int(opts.get("groups", 1))
    m.in_channels, m.out_channels = weight.shape[1] * groups, weight.shape[0]
    m.kernel_size = tuple(weight.shape[2:])
    m.stride = tup(opts.get("stride", 1))
    padding = opts.get("padding", 0)
    m.padding = padding if isinstance(padding, str) else tup(padding)
    m.dilation = tup(opts.get("dilation", 1))
    m.transposed, m.output_padding, m.groups = False, (0,) * d, groups
    m.padding_mode = "zeros"
    if isinstance(m.padding, str):
        m._reversed_padding_repeated_twice = [0, 0] * d
        if m.padding == "same":
            for i, (dil, k) in enumerate(zip(m.dilation, m.kernel_size)):
                total = dil * (k - 1)
                left = total // 2
                j = 2 * (d - 1 - i)
                m._reversed_padding_repeated_twice[j : j + 2] = [left, total - left]
    else:
        m._reversed_padding_repeated_twice = nn.modules.utils._reverse_repeat_tuple(m.padding, 2)
    m._parameters["weight"] = weight
    m._parameters["bias"] = bias
    m._backprism_name = f"{kind} (a functional use of a parameter)"
    return m


def _outputs(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, Tensor) and o.requires_grad]
    return []


def _capture_one(module: nn.Module, x: Tensor, outs: list[Tensor], params: dict) -> None:
    """Capture a stand-in call with the single per-sample input ``x``."""
    capture(module, (x.detach(),), {}, [x], outs, params, live=((x,), {}))


def attribute(func: Any, args: tuple, kwargs: dict, out: Any, name: str | None = None) -> None:
    """Attribute one operation's use of extended parameters (see the module docstring)."""
    for a in args:
        if isinstance(a, (list, tuple)) and a and not _joined(func, args, kwargs, out):
            _nested_uses(a)
    views = [(i, v) for i, a in enumerate(args) if (v := param_view(a)) is not None]
    kw_views = (
        {k: v for k, a in kwargs.items() if (v := param_view(a)) is not None} if kwargs else {}
    )
    if not views and not kw_views:
        return
    if name is None:
        name = residual.op_name(func)
    if kw_views and name in _SIGNATURES:
        args, kwargs = _positional(name, args, kwargs)
        views = [(i, v) for i, a in enumerate(args) if (v := param_view(a)) is not None]
        kw_views = {k: v for k, a in kwargs.items() if (v := param_view(a)) is not None}
    every = [v for _, v in views] + list(kw_views.values())
    owned = frozenset(id(v[0]) for v in every if _is_owned(v[0]))
    if len(owned) == len({id(v[0]) for v in every}):
        if name == "linear" and views and views[0][0] == 1 and views[0][1][2] == "param":
            keep_linear(views[0][1][0], args[0], out)
        return
    if owned:  # claimed by a module in its forward (an uncalled sub-module's bias): constants
        views = [(i, v) for i, v in views if id(v[0]) not in owned]
        kw_views = {k: v for k, v in kw_views.items() if id(v[0]) not in owned}
        every = [v for _, v in views] + list(kw_views.values())
    stack = FORWARD.call_stack
    top = stack[-1] if stack else None
    if not any(
        frame[2] and frame[5] and id(v[0]) in frame[2] for frame in stack for v in every
    ) and not (
        top is not None and top[2] and top[11] is None and all(id(v[0]) in top[2] for v in every)
    ):
        # a use no module hook sees: the model's forwards keep the mode (uses released by a
        # module with replacement functions, or in the body of the releasing module's forward,
        # are optional: the local mode of a forward without the mode attributes them, see
        # forward.pause_body)
        FORWARD.acted += 1
    if FORWARD.joined and name == "linear" and _joined_bias(args, kwargs, out, owned):
        return
    tensors = [
        (i, a)
        for i, a in enumerate(args)
        if isinstance(a, Tensor) and param_view(a) is None and not _constant(a)
    ]
    if name in _VIEW_OPS and len(views) == 1 and not kw_views and not tensors and isinstance(
        out, Tensor
    ):
        p, rebuild, kind = views[0][1]
        pos = views[0][0]
        rest, kw = list(args), dict(kwargs)

        def rebuilt(q: Tensor, rebuild=rebuild, rest=rest, pos=pos, kw=kw) -> Tensor:
            a = list(rest)
            a[pos] = rebuild(q)
            return func(*a, **kw)

        src = args[pos]
        if _expands_batch(name, src, out):
            if src.dim() < out.dim():  # g.expand(N, d): a new leading axis, each slice g

                def source(q: Tensor, rebuild=rebuild) -> Tensor:
                    return rebuild(q).unsqueeze(0)

                broadcast_param(p, source, out)
            else:
                broadcast_param(p, rebuild, out)
            return
        two_d_transpose = name in _TRANSPOSES and p.dim() == 2 and out.dim() == 2
        new_kind = "T" if kind == "param" and two_d_transpose else (
            "derived" if kind == "derived" else "view"
        )
        setattr(out, VIEW, (p, rebuilt, new_kind))
        FORWARD.view_ids.add(id(out))
        return
    if not tensors and not owned and isinstance(out, Tensor) and _derivable(name, every, kwargs):
        _derive(func, args, kwargs, views, kw_views, out)
        return
    outs = _outputs(out)
    frame = releasing_frame(v[0] for v in every)
    undoable = frame is not None and frame[8] is not None
    if not tensors or not outs:
        # no per-sample operand: a releasing module claims its parameters after all; else
        # left to the graph check, which refuses it (naming this)
        if undoable:
            frame[10] = True  # type: ignore[index]
            return
        for o in outs:
            if o.grad_fn is not None:
                o.grad_fn.metadata[UNATTRIBUTED] = f"another parameter in '{name}'"
        return
    x = tensors[0][1]
    if x.dim() == 0 or (undoable and not _per_sample(tensors, frame[9])):  # type: ignore[index]
        if undoable:
            frame[10] = True  # type: ignore[index]
        return
    if (
        not kw_views
        and tensors[0][0] == 0
        and _closed_form(name, args, kwargs, views, x, outs, owned)
    ):
        return
    if (
        name in _STAT_NORMS and tensors[0][0] == 0
        and _stat_norm(name, func, args, kwargs, x, outs, owned)
    ):
        return
    if name == "addmm" and len(args) == 3 and tensors[0][0] == 1 and not kwargs:
        b, w = _pv(args[0], owned), _pv(args[2], owned)
        if b is not None and w is not None and b[2] == "param" and w[2] == "T":
            module = _linear_stand_in(w[0], b[0])
            _capture_one(module, x, outs, {"weight": w[0], "bias": b[0]})
            return
    # everything else: the generic rule on a stand-in re-running the operation
    params: list[nn.Parameter] = []
    index: dict[int, int] = {}
    xs: list[Tensor] = []

    def item(a: Any) -> Any:
        v = param_view(a)
        if v is not None and id(v[0]) in owned:
            return ("c", a)
        if v is not None:
            if id(v[0]) not in index:
                index[id(v[0])] = len(params)
                params.append(v[0])
            return ("p", index[id(v[0])], v[1])
        if isinstance(a, Tensor) and not _constant(a):
            xs.append(a)
            return ("x", len(xs) - 1)
        return ("c", a)

    template = [item(a) for a in args]
    kw_template = {k: item(a) if k in kw_views else ("c", a) for k, a in kwargs.items()}
    module = OpModule(
        func, template, kw_template, params, _linear_use(name, views, kw_views, every)
    )
    capture(
        module,
        tuple(t.detach() for t in xs),
        {},
        xs,
        outs,
        {f"p{i}": p for i, p in enumerate(params)},
        live=(tuple(xs), {}),
    )


#: operations whose result on a parameter is not a function of the parameter alone
_RANDOM_OPS = frozenset(
    {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
     "native_dropout", "bernoulli", "rrelu", "normal", "rand_like", "randn_like", "randint_like",
     "multinomial", "poisson", "uniform_", "normal_", "bernoulli_", "exponential_",
     "geometric_", "cauchy_", "log_normal_", "random_"}
)


def _derivable(name: str, every: list, kwargs: dict) -> bool:
    """An operation on one parameter alone (``self.log_scale.exp()``, ``1 + self.weight``,
    ``F.softplus(self.raw)``): its result is tracked like a view (rebuilt from the parameter),
    so that the operation where it meets the samples is attributed. Not for random operations
    (a rebuild would draw again) nor in-place ones."""
    if name in _RANDOM_OPS or "dropout" in name or (name.endswith("_") and not name.endswith("__")):
        return False
    if any(
        isinstance(a, Tensor) and param_view(a) is None and not _constant(a)
        for a in kwargs.values()
    ):
        return False
    return len({id(v[0]) for v in every}) == 1


def _derive(func: Any, args: tuple, kwargs: dict, views: list, kw_views: dict, out: Tensor) -> None:
    p = (views[0][1] if views else next(iter(kw_views.values())))[0]
    rebuilds = {i: v[1] for i, v in views}
    kw_rebuilds = {k: v[1] for k, v in kw_views.items()}
    rest, kw = list(args), dict(kwargs)

    def derived(q: Tensor) -> Tensor:
        a = list(rest)
        for i, rebuild in rebuilds.items():
            a[i] = rebuild(q)
        k = dict(kw)
        for key, rebuild in kw_rebuilds.items():
            k[key] = rebuild(q)
        return func(*a, **k)

    every = [v for _, v in views] + list(kw_views.values())
    linear = _linear_use(residual.op_name(func), views, kw_views, every)
    setattr(out, VIEW, (p, derived, "view" if linear else "derived"))
    FORWARD.view_ids.add(id(out))


#: operations affine in every operand (DiagHessian: no Hessian term of the parameters)
_AFFINE_OPS = frozenset(
    {"add", "__add__", "__radd__", "__iadd__", "sub", "__sub__", "__rsub__", "__isub__", "neg",
     "__neg__", "cat", "concat", "concatenate", "stack", "hstack", "vstack", "sum", "mean",
     "__getitem__", "index_select", "gather", "pad", "roll", "flip", "narrow", "select",
     "repeat", "tile", "repeat_interleave", "where", "masked_fill", "take_along_dim"}
)
#: operations linear in each operand separately (the parameters must sit in one operand)
_MULTILINEAR_OPS = frozenset(
    {"mul", "__mul__", "__rmul__", "__imul__", "matmul", "__matmul__", "__rmatmul__", "mm",
     "bmm", "einsum", "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
     "conv_transpose2d", "conv_transpose3d", "outer", "mv", "dot", "inner", "tensordot", "kron",
     "div", "__truediv__", "true_divide"}
)


_ELEMENTWISE_OPS = _AFFINE_OPS | {
    "mul", "__mul__", "__rmul__", "__imul__", "div", "__truediv__", "true_divide",
}


def _linear_use(name: str, views: list, kw_views: dict, every: list) -> bool:
    """Whether an operation's output depends linearly on its parameter operands: every one is
    a view of its parameter (no derived value such as ``exp(θ)``), and the operation is affine
    (:data:`_AFFINE_OPS`) or multilinear (:data:`_MULTILINEAR_OPS`) with the parameters in a
    single operand (a numerator for divisions)."""
    if kw_views or any(v[2] == "derived" for v in every):
        return False
    if name in _AFFINE_OPS:
        return True
    if name in _MULTILINEAR_OPS:
        slots = {i for i, _ in views}
        if name in ("div", "__truediv__", "true_divide"):
            return slots == {0}
        return len(slots) == 1
    return False


def _constant(a: Tensor) -> bool:
    """A tensor operand that is the same for every sample: a frozen parameter, or a buffer of
    a module in its forward (a relative-position index), or a view of one
    (``self.relative_position_index.view(-1)``, as timm's Swin and BEiT index their bias
    tables with)."""
    if isinstance(a, nn.Parameter):
        return True  # extended trainable ones are parameter views, never operands here
    base = a._base
    return any(
        b is not None and (a is b or base is b)
        for frame in FORWARD.call_stack
        for b in frame[0]._buffers.values()
    )


def _expanded_mask(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``scaled_dot_product_attention(q, k, v, attn_mask=m)`` with ``m`` a view of a parameter
    of batch size 1 (timm's BEiT passes its relative position bias table, indexed, as the
    mask): ``m`` expanded over the samples first, as an explicit
    :class:`~backprism.engine.broadcast.ParamBroadcast` call (each sample's gradient of the
    table is the pull-back of its own slice), so that the attention is the engine's fused
    attention with a mask that depends on parameters, not a stand-in whose rule re-runs it
    per sample. Not on a batch that folds the samples with windows (its rows are not the
    samples: left to the stand-in)."""
    bound = sdpa_arguments(args, kwargs)
    mask = None if bound is None else bound.get("attn_mask")
    view = param_view(mask) if isinstance(mask, Tensor) else None
    q = None if bound is None else bound["query"]
    if (
        view is None or q is None or q.dim() != mask.dim() or mask.shape[0] != 1
        or q.shape[0] != FORWARD.root_batch
    ):
        return args, kwargs
    p, rebuild, _ = view
    wide = mask.expand(q.shape[0], *mask.shape[1:])  # (also for one sample: its own copy)
    broadcast_param(p, rebuild, wide)
    return with_attn_mask(args, kwargs, wide)


#: joining operations whose result of released parameters may be a linear layer's bias
_JOINS = frozenset({"cat", "concat", "concatenate"})
#: tensor attribute of such a result: ``(dim, parts)``, each part ``("p", view)`` or
#: ``("c", constant)``
JOINED = "_backprism_joined"


def _joined(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """``torch.cat((self.q_bias, self.k_bias, self.v_bias))`` in the forward of a module that
    releases ``q_bias``/``v_bias`` (timm's BEiT, EVA and Swin V2 attention; ``k_bias`` a zero
    buffer): a vector joined from views of parameters released by one module, each once, and
    constants. It is marked (:data:`JOINED`) to be attributed where it is a linear layer's
    bias (:func:`_joined_bias`); any other use (:func:`_joined_uses`), or none before the
    module's forward ends (:func:`~backprism.engine.forward.settle_joined`), undoes the
    release."""
    if residual.op_name(func) not in _JOINS or not isinstance(out, Tensor) or out.dim() != 1:
        return False
    items = args[0]
    if not isinstance(items, (list, tuple)) or any(k != "dim" for k in kwargs):
        return False
    parts: list[tuple[str, Any]] = []
    frame = None
    for a in items:
        v = param_view(a) if isinstance(a, Tensor) else None
        if v is not None:
            f = releasing_frame([v[0]])
            if f is None or f[8] is None or (frame is not None and f is not frame):
                return False
            frame = f
            parts.append(("p", v))
        elif isinstance(a, Tensor) and not a.requires_grad and _constant(a):
            parts.append(("c", a.detach()))
        else:
            return False
    ids = [id(v[0]) for kind, v in parts if kind == "p"]
    if frame is None or len(set(ids)) != len(ids):
        return False
    setattr(out, JOINED, (args[1] if len(args) > 1 else kwargs.get("dim", 0), parts))
    FORWARD.joined[id(out)] = [frame, False, False, out]  # (held: its id is not reused)
    return True


class JoinedBias(nn.Module):
    """Stand-in for the bias of ``F.linear(x, w, torch.cat(parts))`` whose parts are views of
    parameters (``p0``, ``p1``, …) and constants: re-runs the layer with ``w`` as it was and
    the bias rebuilt from its parameters. Its rule (``rules/linear.JoinedBiasRule``) reads
    each part's per-sample gradients off the output gradient, as for a Linear bias. Each part
    is ``(length, parameter index or None, rebuild or constant)``."""

    def __init__(self, weight: Tensor, dim: int, parts: list[tuple[str, Any]]) -> None:
        super().__init__()
        self._weight, self._dim = weight.detach(), dim
        self._parts: list[tuple[int, int | None, Any]] = []
        for kind, part in parts:
            if kind == "p":
                p, rebuild = part[0], part[1]
                i = len(self._parameters)
                self._parameters[f"p{i}"] = p
                with torch.no_grad():
                    self._parts.append((rebuild(p).shape[0], i, rebuild))
            else:
                self._parts.append((part.shape[0], None, part))
        self._backprism_name = "linear bias joined from parameters (a functional use)"

    def forward(self, x: Tensor) -> Tensor:
        pieces = [
            value if i is None else value(getattr(self, f"p{i}")) for _, i, value in self._parts
        ]
        return F.linear(x, self._weight, torch.cat(pieces, self._dim))


def _joined_bias(args: tuple, kwargs: dict, out: Any, owned: frozenset[int]) -> bool:
    """``F.linear(x, w, b)`` with ``b`` joined from released parameters (:func:`_joined`):
    the weight is a Linear stand-in's (its closed forms, Kronecker factors included), the bias
    a :class:`JoinedBias` call on the same output. ``False`` where ``b`` is no such vector."""
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    entry = FORWARD.joined.get(id(bias)) if isinstance(bias, Tensor) else None
    if entry is None or entry[1] or entry[3] is not bias:
        return False
    frame = entry[0]
    entry[1] = True  # (used: any other use undoes the release, forward.settle_joined)
    x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
    w = _pv(weight, owned) if isinstance(weight, Tensor) else None
    usable = (
        isinstance(out, Tensor) and isinstance(x, Tensor) and x.dim() > 0
        and isinstance(weight, Tensor) and _per_sample([(0, x)], frame[9])
        and ((w is None and _frozen(weight, owned)) or (w is not None and w[2] == "param"))
    )
    if not usable:
        frame[10] = True  # (the module claims its parameters after all)
        return True
    if w is not None:
        _capture_one(_linear_stand_in(w[0], None), x, [out], {"weight": w[0]})
    dim, parts = getattr(bias, JOINED)
    module = JoinedBias(weight, dim, parts)
    _capture_one(module, x, [out], dict(module._parameters))
    return True


def _joined_uses(name: str, args: tuple, kwargs: dict) -> str | None:
    """An operation on a joined vector (:func:`_joined`) other than its first use as a linear
    layer's bias undoes its module's release, while that module's forward runs; after it
    (the vector returned), the use cannot be attributed: the names of the vector's
    parameters, which the operation's output records for the graph check's refusal."""
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    escaped = None
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            entry = FORWARD.joined.get(id(t)) if isinstance(t, Tensor) else None
            if entry is None or entry[3] is not t or (
                name == "linear" and t is bias and not entry[1]
            ):
                continue
            if entry[2]:
                escaped = type(entry[0][0]).__name__
            else:
                entry[0][10] = True
    return escaped


def _nested_uses(items: list | tuple) -> None:
    """Parameters (or values rebuilt from them) inside a list operand (``torch.cat([h,
    self.cls.expand(N, -1, -1)], 1)``, ``torch.stack([g, 2 * g])``) are not attributed where
    they enter: a module that released them claims them after all (elsewhere the graph check
    refuses the use)."""
    for a in items:
        v = param_view(a) if isinstance(a, Tensor) else None
        if v is None:
            continue
        frame = releasing_frame([v[0]])
        if frame is not None and frame[8] is not None:
            frame[10] = True


def _per_sample(tensors: list[tuple[int, Tensor]], info: tuple | None) -> bool:
    """Whether every tensor operand is per-sample for its releasing module (``info``: the
    batch size of the module's input and the ids of its tensor arguments): it carries that
    batch (on its batch axis where known), and it either takes a gradient or is one of the
    module's arguments — a tensor without a gradient made inside the forward (a mask, an
    index) may have the batch's size by chance — and it is not the same for every sample
    (:data:`~backprism.engine.state.FREE`: bucket indices from ``torch.arange``, whose axis 0
    would pass for the batch where its size is the batch's; the module's own call is then
    shared by the samples and split where its output meets them, engine.broadcast)."""
    if any(getattr(t, FREE, None) is not None for _, t in tensors):
        return False
    if info is None:
        return True
    n, arg_ids = info
    for _, t in tensors:
        if not t.requires_grad and id(t) not in arg_ids:
            return False
        if getattr(t, _MOVED, False):
            return False  # perhaps transposed (:func:`_mark_transposed`)
        axis = getattr(t, AXIS, None)
        if axis is None:
            axis = 0
        elif axis < 0:  # the batch axis is lost: the module's own call claims the parameters
            return False
        if t.dim() <= axis or t.shape[axis] != n:
            return False
    return True


#: attribute of a tensor that a transpose inside a releasing forward made (:func:`_mark_transposed`)
_MOVED = "_backprism_transposed"


def _mark_transposed(name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """Inside a module's forward that released its parameters to the generic attribution
    (forwards without batch-second layouts, where batch axes are not followed): mark a
    transposed activation with the batch's size on axis 0 (``h.T``, ``h.transpose(0, 1)``),
    which might be taken to have the batch on axis 0 where another axis has the batch's size
    too. A use of a released parameter with such an operand is not attributed where it enters
    (:func:`_per_sample`: the module's own call claims the parameters) — exact either way,
    only slower where the mark was not needed."""
    frame = next((f for f in reversed(FORWARD.call_stack) if f[9] is not None), None)
    src = args[0] if args else None
    if frame is None or not isinstance(src, Tensor) or not isinstance(out, Tensor):
        return
    if src.dim() < 2 or src.shape[0] != frame[9][0] or param_view(src) is not None:
        return
    if name == "mT":
        moved = src.dim() == 2
    elif name in ("movedim", "moveaxis"):
        moved = True
    else:
        moved = _new_axis(name, args, kwargs, src, 0, out) != 0
    if moved:
        setattr(out, _MOVED, True)


def _pv(a: Any, owned: frozenset[int]) -> tuple | None:
    """:func:`~backprism.engine.state.param_view` of ``a`` unless its parameter is claimed by a
    module in its forward (``owned``)."""
    v = param_view(a)
    return None if v is None or id(v[0]) in owned else v


def _frozen(a: Any, owned: frozenset[int]) -> bool:
    """A tensor operand that takes no gradient here: a frozen bias, a buffer, or a parameter
    a module in its forward claims (its call attributes it)."""
    if not isinstance(a, Tensor):
        return False
    v = param_view(a)
    return (v is None and not a.requires_grad) or (v is not None and id(v[0]) in owned)


def _bias_only(w: tuple | None, weight: Any, b: tuple | None, owned: frozenset[int]) -> bool:
    """``F.linear``/``F.conv*`` whose only parameter operand to attribute is the bias, on the
    weight of a parameter that takes no gradient here (frozen: bias-only fine-tuning in a
    layer subclass that calls ``F.linear`` itself, or claimed by a module): the bias gets the
    layer's closed forms (its full Kronecker ``[B]``) rather than the generic stand-in's."""
    return (
        w is None and b is not None and b[2] == "param" and isinstance(weight, nn.Parameter)
        and _frozen(weight, owned)
    )


def _closed_form(
    name: str, args: tuple, kwargs: dict, views: list, x: Tensor, outs: list[Tensor],
    owned: frozenset[int],
) -> bool:
    """Capture ``F.linear``/``x @ w.T``/``addmm``, ``F.embedding``, ``F.conv*`` and the norms
    with a parameter weight as the module whose closed-form rule attributes them (``True``),
    or leave the operation to the generic stand-in (``False``)."""
    if name == "linear" and len(args) >= 2:
        w = _pv(args[1], owned)
        bias = args[2] if len(args) > 2 else None
        b = _pv(bias, owned) if bias is not None else None
        if w is not None and w[2] == "param" and (
            bias is None or (b is not None and b[2] == "param") or _frozen(bias, owned)
        ):
            module = _linear_stand_in(w[0], None if b is None else b[0])
            params = {"weight": w[0]} | ({} if b is None else {"bias": b[0]})
            _capture_one(module, x, outs, params)
            return True
        if _bias_only(w, args[1], b, owned):  # a frozen weight (bias-only fine-tuning)
            _capture_one(_linear_stand_in(args[1], b[0]), x, outs, {"bias": b[0]})
            return True
    if name == "embedding" and len(args) >= 2:
        w = _pv(args[1], owned)
        if w is not None and w[2] == "param" and len(views) == 1:
            module = _embedding_stand_in(w[0], kwargs, tuple(args[2:]))
            _capture_one(module, x, outs, {"weight": w[0]})
            return True
    if name in _CONV_TYPES and len(args) >= 2 and "bias" not in kwargs:
        w = _pv(args[1], owned)
        bias = args[2] if len(args) > 2 else None
        b = _pv(bias, owned) if bias is not None else None
        if w is not None and w[2] == "param" and (
            bias is None or (b is not None and b[2] == "param") or _frozen(bias, owned)
        ):
            module = _conv_stand_in(
                name, w[0], None if b is None else b[0], kwargs, tuple(args[3:])
            )
            params = {"weight": w[0]} | ({} if b is None else {"bias": b[0]})
            _capture_one(module, x, outs, params)
            return True
        if _bias_only(w, args[1], b, owned):
            module = _conv_stand_in(name, args[1], b[0], kwargs, tuple(args[3:]))
            _capture_one(module, x, outs, {"bias": b[0]})
            return True
    if name in _NORMS and not kwargs:
        full = list(args) + [d for _, d in _SIGNATURES[name][len(args) :]]
        slots = (2,) if name == "rms_norm" else (2, 3)
        found: dict[str, nn.Parameter] = {}
        for key, pos in zip(("weight", "bias"), slots):
            a = full[pos]
            v = _pv(a, owned) if a is not None else None
            if v is not None and v[2] == "param":
                found[key] = v[0]
            elif not (a is None or _frozen(a, owned)):
                return False  # a computed scale (adaptive norms): the generic stand-in
        if not found or x is not full[0]:
            return False
        module = _norm_stand_in(name, found.get("weight"), found.get("bias"), full)
        _capture_one(module, x, outs, found)
        return True
    if name in _MATMULS and len(args) == 2 and views and views[0][0] == 1:
        w = views[0][1]
        if w[2] == "T" and x.dim() >= 2:
            module = _linear_stand_in(w[0], None)
            _capture_one(module, x, outs, {"weight": w[0]})
            return True
    return False


def _expands_batch(name: str, src: Any, out: Tensor) -> bool:
    """``src`` (batch axis of size 1) expanded to ``out`` with a larger leading axis, the rest
    unchanged (``cls.expand(N, -1, -1)``), or given a new leading axis
    (``g.expand(N, d)``)."""
    if name not in EXPANDS or not isinstance(src, Tensor) or out.dim() < 1 or out.shape[0] < 2:
        return False
    if src.dim() == out.dim():
        return src.shape[0] == 1 and src.shape[1:] == out.shape[1:]
    return src.dim() + 1 == out.dim() and src.shape == out.shape[1:]


# -- the batch axis of activations computed from a batch_first=False RNN ------------------------
_SWAPS = frozenset({"transpose", "transpose_", "swapaxes", "swapdims"})
#: operations that may move the batch axis (:func:`_mark_transposed`)
_AXIS_MOVES = _SWAPS | {"t", "T", "mT", "permute", "movedim", "moveaxis"}
_FEATURE_OPS = frozenset({"linear", "embedding", "layer_norm", "rms_norm"})
_REDUCTIONS = frozenset(
    {"sum", "mean", "amax", "amin", "max", "min", "nansum", "nanmean", "logsumexp", "prod",
     "std", "var", "norm", "median", "argmax", "argmin"}
)


def _dim(d: Any, ndim: int) -> int | None:
    return d % ndim if isinstance(d, int) and not isinstance(d, bool) and ndim else None


def _index_axis(index: Any, axis: int) -> int:
    """The batch axis after ``x[index]`` (``-1``: the batch was indexed or is lost)."""
    items = index if isinstance(index, tuple) else (index,)
    pos = out = 0
    for item in items:
        if item is None:
            out += 1
            continue
        if item is Ellipsis or isinstance(item, bool) or not isinstance(item, (int, slice)):
            return -1
        if pos == axis:
            return out if item == slice(None) else -1
        pos += 1
        if isinstance(item, slice):
            out += 1
    return out + (axis - pos)


def _new_axis(name: str, args: tuple, kwargs: dict, src: Tensor, axis: int, out: Tensor) -> int:
    """The batch axis of ``out = op(src, ...)`` for the operations whose layout is known;
    ``-1`` (unknown) for every other one."""
    nd = src.dim()
    if name in _SWAPS and len(args) >= 3:
        d0, d1 = _dim(args[1], nd), _dim(args[2], nd)
        if d0 is None or d1 is None:
            return -1
        return d1 if axis == d0 else d0 if axis == d1 else axis
    if name in ("t", "T") and nd == 2:
        return 1 - axis
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        dims = [_dim(d, nd) for d in dims]
        return dims.index(axis) if axis in dims and len(dims) == nd else -1
    if name == "__getitem__" and len(args) == 2:
        return _index_axis(args[1], axis)
    if name in _REDUCTIONS:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None or isinstance(dim, str):
            return -1
        dims = [_dim(d, nd) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
        if None in dims or axis in dims:
            return -1
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        return axis if keep is True else axis - sum(d < axis for d in dims)
    if name in _FEATURE_OPS and axis < nd - (0 if name == "embedding" else 1):
        return axis  # acts on the trailing feature axis (embedding: appends one)
    if out.shape == src.shape and name not in ("movedim", "moveaxis", "flip", "roll"):
        return axis  # elementwise (activations, dropout, scaling, residual additions)
    return -1


def follow_batch_axis(name: str, args: tuple, kwargs: dict, out: Any) -> None:
    """Carry the batch axis (:data:`~backprism.engine.state.AXIS`) of a marked operand to the
    outputs of an operation: exactly for transposes, permutations, indexing, reductions and
    shape-preserving (elementwise) operations, as *unknown* for anything else, so that a
    module or loss consuming the result refuses instead of taking axis 0 for the batch."""
    src = None
    for a in args:
        if isinstance(a, Tensor):
            axis = getattr(a, AXIS, None)
            if axis is not None:
                src = (a, axis)
                break
        elif isinstance(a, (tuple, list)) and any(
            isinstance(t, Tensor) and getattr(t, AXIS, None) is not None for t in a
        ):
            src = (None, -1)  # cat / stack of marked tensors: not followed
            break
    if src is None:
        return
    if isinstance(out, Tensor):
        outs = [out]
    elif isinstance(out, (tuple, list)):
        outs = [o for o in out if isinstance(o, Tensor)]
    else:
        return
    for o in outs:
        axis = -1 if src[0] is None or src[1] < 0 else _new_axis(
            name, args, kwargs, src[0], src[1], o
        )
        setattr(o, AXIS, axis)  # 0 too: known, not assumed


#: operations that only read a tensor's metadata (``x.shape``, ``x.dtype``, ``x.dim()``, …):
#: nothing to attribute or record; a large share of the operations a forward dispatches
_INERT = frozenset(
    {
        "shape", "dtype", "device", "dim", "ndim", "ndimension", "size", "numel", "nelement",
        "is_nested", "is_floating_point", "is_complex", "is_contiguous", "is_cuda", "is_cpu",
        "is_meta", "is_sparse", "is_quantized", "layout", "requires_grad", "stride",
        "storage_offset", "element_size", "get_device", "data_ptr", "names", "__len__",
        "is_leaf", "grad_fn", "output_nr", "_version", "is_inference", "__bool__", "item",
        "tolist", "__format__", "__repr__", "__hash__", "__index__", "__int__", "__float__",
    }
)
#: function → (op name, inert, residual kind, in place: :func:`_mutates`, the position of
#: an ``inplace`` flag: :func:`_inplace_index`); functions are few and long-lived
_INFO: dict[Any, tuple[str, bool, int, bool, int | None]] = {}


def _info(func: Any) -> tuple[str, bool, int, bool, int | None]:
    try:
        return _INFO[func]
    except (KeyError, TypeError):
        pass
    name = residual.op_name(func)
    info = (name, name in _INERT, residual.classify(name), _mutates(name), _inplace_index(func))
    if len(_INFO) > 4096:  # bounded even if callables are created on the fly
        _INFO.clear()
    with contextlib.suppress(TypeError):  # unhashable callable: not cached
        _INFO[func] = info
    return info


#: attention entry points that may pick a fused kernel without a second derivative
_ATTENTION = frozenset({"scaled_dot_product_attention", "multi_head_attention_forward"})


def _math_attention() -> Any:
    """A context computing attention with PyTorch's (twice differentiable) math kernel."""
    if _sdpa_kernel is None:  # pragma: no cover - torch < 2.3
        return contextlib.nullcontext()
    return _sdpa_kernel([_SDPBackend.MATH])


def _inplace_index(func: Any) -> int | None:
    """The position of ``func``'s ``inplace`` parameter (``F.relu``: 1, ``F.leaky_relu``: 2,
    ``F.dropout``: 3), or ``None``; functions without a Python signature have none."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _writes_first(index: int | None, args: tuple, kwargs: dict) -> bool:
    """Whether a call of a function with an ``inplace`` flag (at position ``index``) writes
    into its first operand."""
    if "inplace" in kwargs:
        return bool(kwargs["inplace"])
    return index is not None and len(args) > index and bool(args[index])


def _mutates(name: str) -> bool:
    """An operation that modifies its first operand in place (``w[0] = 0``, ``w.clamp_()``)."""
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__")) or (
        name.startswith("__i") and name.endswith("__")
    )


def _invalidate_view(t: Tensor) -> None:
    """``t``, tracked as a value rebuilt from a parameter (a view, a clone), is modified in
    place: the rebuild no longer gives its value, so it is no longer tracked. A use of it
    then cannot be attributed where it enters: a releasing module claims its parameters
    after all; elsewhere the graph check refuses the use."""
    view = getattr(t, VIEW, None)
    if view is None:
        return
    with contextlib.suppress(AttributeError):
        delattr(t, VIEW)
    FORWARD.view_ids.discard(id(t))
    frame = releasing_frame([view[0]])
    if frame is not None and frame[8] is not None:
        frame[10] = True


def _in_place_forms() -> dict[str, tuple[Any, str, int]]:
    """In-place arithmetic → ``(out-of-place function, its name, residual kind)``."""
    forms = {}
    for op in ("mul", "add", "sub", "div", "addcmul", "addcdiv", "true_divide", "multiply"):
        oop = getattr(Tensor, op, None)
        if oop is not None:
            forms[op + "_"] = (oop, op, residual.classify(op))
    for op in ("mul", "add", "sub", "truediv"):
        oop = getattr(Tensor, f"__{op}__")
        forms[f"__i{op}__"] = (oop, f"__{op}__", residual.classify(f"__{op}__"))
    return forms


#: in-place arithmetic that a parameter may enter (``x.mul_(self.gamma)``, ``h += self.bias``)
_IN_PLACE = _in_place_forms()


def _in_place_parameter_use(args: tuple) -> bool:
    """An in-place operation on a per-sample tensor with an extended parameter (or a view of
    one) among its other operands that no module in its forward claims."""
    if not args or not isinstance(args[0], Tensor) or param_view(args[0]) is not None:
        return False
    views = [v for a in args[1:] if (v := param_view(a)) is not None]
    return bool(views) and not all(_is_owned(v[0]) for v in views)


class ForwardMode(TorchFunctionMode):
    """Active during every top-level forward of an extended model: attributes functional
    parameter uses and, when ``record``, records nonlinearities for DiagHessian.

    Every operation of the forward passes through :meth:`__torch_function__`, so the common
    cases leave early: metadata reads, and results that are not tensors requiring grad (no
    parameter can have been used differentiably)."""

    def __init__(self, record: bool, math_attention: bool = False) -> None:
        super().__init__()
        self.record = record
        #: a collect with an extension that needs double backward is active: attention runs
        #: with the math kernel
        self.math_attention = math_attention

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        name, inert, kind, in_place, flag = _info(func)
        if inert or FORWARD.suspended or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        escaped = _joined_uses(name, args, kwargs) if FORWARD.joined else None
        if not in_place and (flag is not None or "inplace" in kwargs):
            # F.relu(x, inplace=True), F.leaky_relu(x, 0.1, True): nn.ReLU(inplace=True)
            in_place = _writes_first(flag, args, kwargs)
        if in_place and args:
            if id(args[0]) in FORWARD.view_ids:
                _invalidate_view(args[0])
            if isinstance(args[0], Tensor) and hasattr(args[0], SHARED):
                before_in_place(name, args[0], written=in_place)
        if name in MEETS:
            args, kwargs = broadcast_calls(name, args, kwargs)
            if name == "scaled_dot_product_attention":
                args, kwargs = _expanded_mask(args, kwargs)
        elif name in DROPOUT:
            mask = dropout_mask(args, kwargs)
            if mask is not None:  # (a shared tensor's: a product with a constant mask)
                return self.__torch_function__(torch.mul, types, (args[0], mask))
        stack = FORWARD.call_stack
        top = stack[-1] if stack else None
        replacement = None if top is None or top[5] is None else top[5].get(name)
        if replacement is not None:
            # it runs the operations where released parameters enter with the mode re-entered
            out = replacement(self, *args, **kwargs)
            if out is not NotImplemented:
                return out  # attributed, recorded and followed inside
        target = None
        if name in _IN_PLACE and _in_place_parameter_use(args):
            # x.mul_(self.gamma): the value of x before the operation is what the parameter
            # multiplies; run the out-of-place form (attributed as usual) and copy it back
            target = args[0]
            func, name, kind = _IN_PLACE[name]
            args = (target.clone(), *args[1:])  # the call's input, which the copy leaves intact
        if self.math_attention and name in _ATTENTION:
            with _math_attention():
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if FORWARD.layouts:  # activations with the batch off axis 0 exist in this forward
            follow_batch_axis(name, args, kwargs, out)
        elif name in _AXIS_MOVES and stack:
            _mark_transposed(name, args, kwargs, out)
        out = after_operation(name, func, args, kwargs, out, in_place)
        if escaped is not None:
            for o in _outputs(out):
                if o.grad_fn is not None:
                    o.grad_fn.metadata[ESCAPED] = escaped
        if isinstance(out, Tensor):
            if not out.requires_grad:
                return out
        elif not isinstance(out, (tuple, list)):
            return out
        if self.record:
            residual.record(func, name, kind, args, kwargs, out)
        attribute(func, args, kwargs, out, name)
        if target is not None:
            target.copy_(out)
            if hasattr(out, AXIS):
                setattr(target, AXIS, getattr(out, AXIS))
            return target
        return out

    def call(self, func: Callable[..., Any], *args: Any) -> Any:
        """``func(*args)`` run through the mode (used by rules' replacement functions, which
        run with the mode switched off)."""
        with self:
            return func(*args)


class DirectAttribution:
    """What :meth:`ForwardMode.call` does, without entering a mode: for the replacement
    functions of a releasing module run by :class:`ReleaseMode` in a forward without the mode,
    where nothing is recorded, no batch axis is followed and attention keeps its kernel — only
    the parameter uses are attributed. Saves a mode's entry, exit and dispatch per call."""

    @staticmethod
    def call(func: Callable[..., Any], *args: Any) -> Any:
        out = func(*args)
        if isinstance(out, Tensor) and out.requires_grad:
            attribute(func, args, {}, out, _info(func)[0])
        return out


_DIRECT = DirectAttribution()


#: a model not seen yet for a ``training`` flag (:data:`~backprism.engine.state.MODE_FREE`)
_UNSEEN = object()
#: :data:`~backprism.engine.state.MODE_FREE`'s keys ``(_UNRECORDED, training)``: learned from
#: forwards inside ``collect()`` that record no nonlinearities, used by such forwards only
_UNRECORDED = "unrecorded"


def _functorch_level() -> Any:
    """The innermost active ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, …), or
    ``None``: forwards inside one always run with the mode (it also keeps attention off the
    fused kernels those transforms cannot differentiate)."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return None if peek is None else peek()


def _enter(root: nn.Module) -> None:
    """Enter the forward mode for a top-level forward of ``root`` — unless the forward runs
    outside any ``collect()`` and an earlier recorded forward of ``root`` (same ``training``
    flag) showed that the mode has nothing to do in it (no functional parameter use, no
    nonlinearity outside activation modules, no broadcast call, no batch off axis 0; or
    functional nonlinearities only in a graph where the DiagHessian family, which alone uses
    their records, is refused anyway: a softmax or norm, as in every transformer, see
    :func:`~backprism.engine.residual.node_ops`). Such a forward pays for no per-operation
    dispatch. Its backward checks what the mode would have
    seen in the graph (:mod:`backprism.engine.graph`'s attribution,
    :func:`backprism.engine.residual.check_pass`'s node walk) and refuses, never misses, what
    a different path needs; the model is then recorded again
    (:func:`~backprism.engine.state.forget_mode_free`)."""
    FORWARD.view_ids.clear()  # views of parameters are tracked per top-level forward
    FORWARD.joined.clear()
    FORWARD.widened.clear()
    FORWARD.rows_pending = 0
    if not torch.is_grad_enabled():  # an evaluation forward: nothing to attribute or record
        FORWARD.modes.append(None)
        return
    record = residual.recording_wanted()
    ctx = active()
    math = ctx is not None and any(e.needs_double_backward for e in ctx.extensions)
    learn: Any = None
    # outside collect() a forward that records nonlinearities; inside one, a forward that
    # records none (no DiagHessian-family extension) and needs no double backward. What such a
    # forward learns serves it alone: a forward that records may not trust operations seen by
    # one that did not (the refusals among them carry no site there)
    key: Any = root.training if ctx is None else (_UNRECORDED, root.training)
    if (record if ctx is None else not record and not math) and _functorch_level() is None:
        table = MODE_FREE.get(root, {})
        known = table.get(root.training, _UNSEEN)
        if known is _UNSEEN and ctx is not None:
            known = table.get(key, _UNSEEN)
        if known is not _UNSEEN and known is not None:
            FORWARD.modes.append(None)  # activation modules' hooks record their sites
            FORWARD.free_ops = known  # type: ignore[assignment]
            if ctx is not None and residual.recording_enabled():
                FORWARD.unrecorded += 1  # its calls are marked, as the mode marks them
                FORWARD.free_unrecorded = True
            return
        # learn from a forward with the model's own (extended) parameters only, not one
        # through torch.func.functional_call's stand-ins
        if known is _UNSEEN and all(
            getattr(p, "_backprism_hooked", False)  # (ids of dropped parameters get reused)
            for p in root.parameters()
            if p.requires_grad
        ):
            learn = key
    mode = ForwardMode(record, math)
    mode.learn = learn  # type: ignore[attr-defined]
    FORWARD.acted = FORWARD.residual_acts = FORWARD.deferred_acts = 0
    # inside a collect() without DiagHessian the nonlinearities are deliberately not recorded;
    # calls are marked so that such an extension in a later backward refuses them
    mode.skipped = not record and residual.recording_enabled()  # type: ignore[attr-defined]
    FORWARD.unrecorded += int(mode.skipped)  # type: ignore[attr-defined]
    FORWARD.recording += int(record)
    mode.__enter__()
    FORWARD.modes.append(mode)


def _exit(root: nn.Module, output: Any) -> None:
    FORWARD.free_ops = None
    FORWARD.widened.clear()
    FORWARD.joined.clear()
    FORWARD.rows_pending = 0
    if FORWARD.free_unrecorded:
        FORWARD.free_unrecorded = False
        FORWARD.unrecorded -= 1
    if FORWARD.modes:
        mode = FORWARD.modes.pop()
        if mode is None:
            return
        FORWARD.recording -= int(mode.record)
        FORWARD.unrecorded -= int(mode.skipped)  # type: ignore[attr-defined]
        mode.__exit__(None, None, None)
        if mode.learn is not None and torch.is_grad_enabled():  # type: ignore[attr-defined]
            # (only Hessian residual records, or widenings a backward pass does as well)
            free = (
                FORWARD.acted == FORWARD.residual_acts + FORWARD.deferred_acts
                and not FORWARD.layouts
            )
            known = MODE_FREE.setdefault(root, {})
            known[mode.learn] = (  # type: ignore[attr-defined]
                residual.node_ops(
                    output,
                    # (records only a DiagHessian-family pass reads: kept for the models
                    # that use one)
                    refused_only=FORWARD.residual_acts > 0 and residual.residuals_wanted(root),
                    params={id(p) for p in root.parameters() if p.requires_grad},
                )
                if free
                else None
            )


class ReleaseMode(TorchFunctionMode):
    """Entered for one releasing module's forward (:attr:`~backprism.engine.state.Inside`)
    inside a top-level forward without :class:`ForwardMode`: runs the rule's replacement of
    the functions it names, which attribute the released parameters' uses with a
    :class:`ForwardMode` of their own, and passes every other operation through at the cost of
    one name lookup."""

    def __init__(self, functions: dict[str, Callable[..., Any]]) -> None:
        super().__init__()
        self.functions = functions
        #: with a batch axis off axis 0 in the forward the mode follows it through the
        #: replacement's operations
        self.inner = ForwardMode(False)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        replacement = self.functions.get(getattr(func, "__name__", ""))
        if replacement is not None and not FORWARD.suspended and torch.is_grad_enabled():
            inner = self.inner if FORWARD.layouts else _DIRECT
            out = replacement(inner, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def _local_mode(functions: dict[str, Callable[..., Any]] | None) -> TorchFunctionMode:
    """The local mode of one releasing module's forward inside a top-level forward without
    :class:`ForwardMode`: :class:`ReleaseMode` for a module with replacement functions, else a
    :class:`ForwardMode` that records nothing, entered for the forward's body only
    (:func:`~backprism.engine.forward.pause_body`)."""
    return ReleaseMode(functions) if functions else ForwardMode(False)


_forward.LOCAL_MODE[0] = _local_mode

if (_enter, _exit) not in FORWARD_LISTENERS:
    FORWARD_LISTENERS.append((_enter, _exit))
