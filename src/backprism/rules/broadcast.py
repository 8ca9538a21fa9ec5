r"""Rule for a parameter expanded over the batch (:class:`~backprism.engine.functional.
ParamBroadcast`, e.g. a class token ``cls.expand(N, -1, -1)``).

Every sample's slice of the output is ``s(θ) = source(θ)[0]``, so with ``g[m, n]`` the slice of
the columns at sample ``n``,

.. math:: V_{mn} = \Big(\frac{∂ s(θ)}{∂θ}\Big)^{\!\top} g_{m,n} \qquad [M, N, *θ.shape],

computed as one ``vmap``-ped vector-Jacobian product of ``s`` (linear, so exact). The scaling is
that of ``g`` (first order: ``g[0] = ∂L/∂out`` holds the ``1/N`` of a mean loss). Statistics
come from the :class:`~backprism.engine.rule.Rule` defaults (the parameter is small).
"""

from __future__ import annotations

from torch import Tensor

from backprism.engine.broadcast import ParamBroadcast
from backprism.engine.columns import pull_back
from backprism.engine.rule import Call, Rule, register_rule


@register_rule(ParamBroadcast)
class BroadcastRule(Rule):
    def per_sample(self, call: Call, g: Tensor) -> dict[str, Tensor]:
        module = call.module
        p = module._parameters["p0"].detach()
        m, n = g.shape[0], g.shape[1]
        flat = g.reshape(m * n, *g.shape[2:]).to(p.dtype)
        (out,) = pull_back(lambda q: (module.source(q)[0],), (p,), (flat,))
        return {"p0": out.reshape(m, n, *p.shape)}
