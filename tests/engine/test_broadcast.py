"""Calls whose output all samples share, widened over the batch where they meet it
(:mod:`backprism.engine.broadcast`).

A relative position bias — an ``Embedding`` (or a module without a closed-form rule) called on
``[T, T]`` bucket indices, without the batch axis — reshaped like T5's
(``.permute(2, 0, 1).unsqueeze(0)``, or one head selected), passed through ``torch.where`` with a
causal mask (a constant, followed) or a per-sample padding mask (where it meets the samples),
and added to every layer's per-sample scores or given to ``scaled_dot_product_attention`` as
its mask: every parameter's per-sample gradients and the GGN diagonal and square root against
dense float64 ``torch.func`` references. Used also where it was not widened: refused before
anything is written. Hypothesis draws the layout, the kernel, the sizes (``T = N`` included)
and the number of layers sharing one bias.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from backprism import collect, extend
from backprism.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from tests.common import (
    assert_first_order,
    assert_nothing_written,
    check_first_order_e2e,
    gather,
)
from tests.reference import batch_diag_ggn_loop, diag_blocks, ggn_blocks, per_sample_grads

DT = torch.float64
TOL = {"atol": 1e-10, "rtol": 1e-8}
D, H, C = 4, 2, 3
LAYOUTS = ("select", "t5", "t5_padding", "t5_causal", "t5_expanded")


class Table(nn.Module):
    """A bias table without a closed-form rule (the generic rule): ``w[buckets] * s``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, H))
        self.s = nn.Parameter(torch.rand(H) + 0.5)

    def forward(self, buckets: Tensor) -> Tensor:
        return self.w[buckets] * self.s


class ContainerTable(Table):
    """:class:`Table` with a sub-module: a container, whose own parameters are released to
    attribution where they enter (``engine.functional``); its operand ``buckets`` is the same
    for every sample, so the release is undone and the call is shared by the samples."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Identity()


class SharedBias(nn.Module):
    """``layers`` attention-like layers whose scores get one relative position bias computed
    once from ``[T, T]`` bucket indices (no batch axis), laid out by ``layout``; ``kernel``
    ``"add"`` adds it to the scores, ``"sdpa"`` passes it as the attention mask."""

    def __init__(self, layout: str, kernel: str, layers: int, table: str) -> None:
        super().__init__()
        self.layout, self.kernel = layout, kernel
        self.bias = (
            nn.Embedding(3, H) if table == "embedding"
            else ContainerTable() if table == "container" else Table()
        )
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(layers))
        self.head = nn.Linear(D, C)

    def position_bias(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        pos = torch.arange(t)
        buckets = (pos[None, :] - pos[:, None]).clamp(-1, 1) + 1  # [T, T]
        values = self.bias(buckets)  # [T, T, H]
        if self.layout == "select":
            return values[..., 0]  # [T, T]: one head, broadcast by rank
        pb = values.permute([2, 0, 1]).unsqueeze(0)  # [1, H, T, T], as T5's compute_bias
        if self.layout == "t5_padding":  # per-sample keys masked: meets the samples here
            keep = (x[:, None, None, :, 0] > -0.5).expand(n, 1, t, t)
            return torch.where(keep, pb, -1e4)
        if self.layout == "t5_expanded":  # over the samples explicitly
            return pb.expand(n, -1, -1, -1)
        if self.layout == "t5_causal":  # a constant mask: followed, meets them later
            causal = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)
            return torch.where(causal, pb, -1e4).contiguous()
        return pb

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x, self.position_bias(x))

    def layers(self, x: Tensor, pb: Tensor) -> Tensor:
        n, t, _ = x.shape
        for qkv in self.qkv:
            q, k, v = qkv(x).view(n, t, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
            if self.kernel == "sdpa":  # (the CPU flash kernel has no gradient for a mask)
                with sdpa_kernel(SDPBackend.MATH):
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=pb)
            else:
                o = ((q @ k.transpose(-1, -2)) / (D // H) ** 0.5 + pb).softmax(-1) @ v
            x = x + torch.tanh(o.transpose(1, 2).reshape(n, t, D))
        return self.head(x.mean(1))


def _setup(layout: str, kernel: str, layers: int, table: str, n: int, t: int, seed: int = 0):
    torch.manual_seed(seed)
    model = SharedBias(layout, kernel, layers, table).to(DT)
    x = torch.randn(n, t, D, dtype=DT)
    x[0, :, 0] = -1.0  # sample 0's keys all masked by "t5_padding": its softmax is uniform
    x[0, 0, 0] = 1.0
    return model, x, torch.randint(0, C, (n,))


def _qk_scores(qk: nn.Linear, x: Tensor) -> Tensor:
    """Per-head scores ``q kᵀ`` ``[N, H, T, T]`` of a packed ``[q, k]`` projection."""
    n, t, _ = x.shape
    q, k = qk(x).view(n, t, 2, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
    return q @ k.transpose(-1, -2)


def _refused(model: nn.Module, x: Tensor, match: str) -> None:
    """``model``'s pass on ``x`` is refused (``match``) before anything is written."""
    loss = F.cross_entropy(model(x), torch.randint(0, C, (x.shape[0],)))
    with pytest.raises(RuntimeError, match=match), collect(BatchGrad()):
        loss.backward()
    assert_nothing_written(model, grad_too=True)


def _first_order_and_ggn(model: nn.Module, x: Tensor, y: Tensor) -> None:
    """First order and the GGN diagonal of ``model`` (not yet extended) against ``torch.func``."""
    lossfunc = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lossfunc, x, y)
    G = ggn_blocks(model, lossfunc, x, y)[0]
    extend(model)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact()):
        lossfunc(model(x), y).backward()
    assert_first_order(model, ref, **TOL)
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **TOL
    )


def _exact(make: Callable[[], nn.Module], n: int, *shape: int) -> None:
    """:func:`_first_order_and_ggn` of ``make()`` (seeded) on ``n`` random inputs of
    ``shape``."""
    torch.manual_seed(0)
    model = make().to(DT)
    _first_order_and_ggn(model, torch.randn(n, *shape, dtype=DT), torch.randint(0, C, (n,)))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    layout=st.sampled_from(LAYOUTS),
    kernel=st.sampled_from(["add", "sdpa"]),
    layers=st.integers(1, 2),
    table=st.sampled_from(["embedding", "generic", "container"]),
    n=st.integers(1, 4),
    t=st.integers(1, 4),
)
def test_shared_bias_first_order(
    layout: str, kernel: str, layers: int, table: str, n: int, t: int
) -> None:
    """Every parameter's per-sample gradients, their norms, second moment and variance equal
    the definition's (``Σₙ grad_batch = .grad`` included), the shared table's too; also for
    one sample (a rank's last batch under DDP), where the table meets an operand of axis 0 of
    size 1 and is widened to it all the same (it was refused: calls of batch sizes 1 and T)."""
    model, x, y = _setup(layout, kernel, layers, table, n, t)
    lossfunc = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lossfunc, x, y)
    extend(model)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(model(x), y).backward()
    assert_first_order(model, ref, **TOL)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_container_table_of_the_batch_size(layout: str, n: int) -> None:
    """A container's own table indexed by ``[T, T]`` buckets with ``T = N``: the buckets' axis
    0 is not the batch (before, the release attributed ``w[buckets]`` per row of the buckets:
    silently wrong here, refused for ``T ≠ N``)."""
    model, x, y = _setup(layout, "add", 2, "container", n, n)
    check_first_order_e2e(model, nn.CrossEntropyLoss(), x, y)


@pytest.mark.parametrize("n", [3, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_bias_exact_ggn(layout: str, n: int) -> None:
    """The GGN diagonal, per-sample diagonal and square root, the shared table's included."""
    model, x, y = _setup(layout, "add", 2, "embedding", n, 3)
    lossfunc = nn.CrossEntropyLoss()
    G = ggn_blocks(model, lossfunc, x, y)[0]
    extend(model)
    with collect(DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact()):
        lossfunc(model(x), y).backward()
    torch.testing.assert_close(
        gather(model, "diag_ggn_exact", 0), torch.diagonal(G.sum((0, 1))), **TOL
    )
    torch.testing.assert_close(gather(model, "diag_ggn_exact_batch", 1), diag_blocks(G), **TOL)
    V = gather(model, "sqrt_ggn_exact", 2)
    for i in range(x.shape[0]):
        torch.testing.assert_close(V[:, i].T @ V[:, i], G[i, i], **TOL)


class AlsoUsedElsewhere(SharedBias):
    """The bias split per sample where it meets the scores, and also added (summed) to the
    output, where its gradient is every sample's at once."""

    def forward(self, x: Tensor) -> Tensor:
        pb = self.position_bias(x)
        return self.layers(x, pb) + pb.sum()


def test_a_shared_output_also_used_unsplit_is_refused() -> None:
    model, x, y = _setup("t5", "add", 1, "embedding", 3, 4)
    model.__class__ = AlsoUsedElsewhere
    extend(model)
    loss = F.cross_entropy(model(x), y)
    with pytest.raises(RuntimeError, match="also used elsewhere"), collect(BatchGrad()):
        loss.backward()
    assert_nothing_written(model, grad_too=True)


class MatrixProduct(nn.Module):
    """A shared table ``[T, T]`` meeting the samples inside a matrix product, ``table @ x``:
    matmul broadcasts it over the batch axis of ``x`` like an elementwise operation, so it is
    widened there."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Embedding(3, 1)
        self.head = nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        pos = torch.arange(t)
        table = self.bias((pos[None, :] - pos[:, None]).clamp(-1, 1) + 1)[..., 0]
        return self.head((table @ x).mean(1))


@pytest.mark.parametrize("n", [2, 5])
def test_a_shared_table_in_a_matrix_product(n: int) -> None:
    """Also where its leading size ``T`` equals ``N`` (split along ``T`` once, silently)."""
    _exact(MatrixProduct, n, 5, D)


class PositionsTwice(nn.Module):
    """Position embeddings of ``[1, T]`` positions added to the tokens in two places: each
    addition widens the call again (the second used to be dropped, silently)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Linear(D, D)
        self.pos = nn.Embedding(6, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        p = self.pos(torch.arange(x.shape[1])[None])  # [1, T, D]
        h = torch.tanh(self.tok(x) + p)
        return self.head((self.mid(h) * p).mean(1))


def test_a_batch_one_call_broadcast_twice() -> None:
    torch.manual_seed(0)
    model = PositionsTwice().to(DT)
    x, y = torch.randn(3, 5, D, dtype=DT), torch.randint(0, C, (3,))
    lossfunc = nn.CrossEntropyLoss()
    ref = per_sample_grads(model, lossfunc, x, y)
    extend(model)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(model(x), y).backward()
    assert_first_order(model, ref, **TOL)


class GridEncoding(nn.Module):
    """XCiT's positional encoding: a convolution (batch size 1, its own rule) on a
    ``[1, 2, H, W]`` coordinate grid without the samples, through an activation, copied over
    the batch by ``repeat(N, 1, 1, 1)`` or ``expand(N, -1, -1, -1)`` and added to the
    samples' features."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.pos = nn.Conv2d(2, 4, 1)
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, C)

    def forward(self, x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        axes = (torch.linspace(-1, 1, h, dtype=x.dtype), torch.linspace(-1, 1, w, dtype=x.dtype))
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"))[None]  # [1, 2, H, W]
        pos = torch.tanh(self.pos(grid))
        pos = pos.repeat(n, 1, 1, 1) if self.how == "repeat" else pos.expand(n, -1, -1, -1)
        return self.head((self.stem(x) + pos).mean((2, 3)))


@pytest.mark.parametrize("how", ["repeat", "expand"])
def test_a_batch_one_convolution_copied_over_the_batch(how: str) -> None:
    torch.manual_seed(0)
    model = GridEncoding(how).to(DT)
    x, y = torch.randn(3, 3, 4, 5, dtype=DT), torch.randint(0, C, (3,))
    _first_order_and_ggn(model, x, y)


class CoordinateMlp(nn.Module):
    """timm's ``RelPosMlp``: a two-layer MLP on a buffer of relative coordinates
    ``[T, T, 2]`` (the same for every sample), its output ``[T, T, H]`` laid out as
    ``[1, H, T, T]`` and added to the scores."""

    def __init__(self, t: int) -> None:
        super().__init__()
        pos = torch.arange(t, dtype=DT)
        rel = pos[:, None] - pos[None, :]
        self.register_buffer("coords", torch.stack([rel, rel.abs()], -1))  # [T, T, 2]
        self.fc1, self.fc2 = nn.Linear(2, 4), nn.Linear(4, H)
        self.qk = nn.Linear(D, 2 * D)
        self.head = nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        bias = self.fc2(F.gelu(self.fc1(self.coords))).permute(2, 0, 1).unsqueeze(0)
        attn = (_qk_scores(self.qk, x) + bias).softmax(-1)  # [N, H, T, T]
        return self.head((attn.mean(1) @ x).mean(1))


@pytest.mark.parametrize("n", [2, 4])
def test_a_shared_value_of_two_modules(n: int) -> None:
    """The second module is run again on each sample's copy of its input, which widens the
    first one in turn; also where ``T = N`` (split along ``T`` once, silently)."""
    _exact(lambda: CoordinateMlp(4), n, 4, D)


class BiasTable(nn.Module):
    """A relative position bias table read by a module called without tensor inputs (Hugging
    Face's BEiT): ``table[index]`` laid out as ``[H, T, T]``."""

    def __init__(self, t: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * t - 1, H) * 0.5)
        pos = torch.arange(t)
        self.register_buffer("index", (pos[:, None] - pos[None, :] + t - 1).reshape(-1))

    def forward(self, t: int) -> Tensor:
        return self.table[self.index].view(t, t, H).permute(2, 0, 1)


class WithTable(nn.Module):
    def __init__(self, t: int) -> None:
        super().__init__()
        self.rel = BiasTable(t)
        self.qk = nn.Linear(D, 2 * D)
        self.head = nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        attn = (_qk_scores(self.qk, x) + self.rel(x.shape[1]).unsqueeze(0)).softmax(-1)
        return self.head((attn.mean(1) @ x).mean(1))


@pytest.mark.parametrize("n", [3, 4])
def test_a_module_called_without_tensor_inputs(n: int) -> None:
    """Its output is widened where it meets the samples (the generic rule pulls each sample's
    gradient back through the module's one output), also where ``T = N``."""
    torch.manual_seed(0)
    model = WithTable(4).to(DT)
    x, y = torch.randn(n, 4, D, dtype=DT), torch.randint(0, C, (n,))
    _first_order_and_ggn(model, x, y)


class TableInProduct(WithTable):
    """The table of a module without tensor inputs met inside a matrix product."""

    def forward(self, x: Tensor) -> Tensor:
        attn = _qk_scores(self.qk, x).softmax(-1) @ self.rel(x.shape[1])  # [N, H, T, T]
        return self.head((attn.mean(1) @ x).mean(1))


@pytest.mark.parametrize("n", [3, 4])
def test_a_module_without_tensor_inputs_in_a_matrix_product(n: int) -> None:
    _exact(lambda: TableInProduct(4), n, 4, D)


class ProjectedPositions(nn.Module):
    """Position embeddings of ``torch.arange(T)`` through a Linear layer, added to the tokens:
    a shared value of two modules in a row, its lower rank widened at the addition."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.proj = nn.Embedding(5, D), nn.Linear(D, D)
        self.tok, self.head = nn.Linear(3, D), nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        pos = self.proj(self.pos(torch.arange(x.shape[1])))  # [T, D]
        return self.head(torch.tanh(self.tok(x) + pos).mean(1))


@pytest.mark.parametrize("n", [3, 5])
def test_projected_positions(n: int) -> None:
    """Also where ``T = N`` (the embedding was split along ``T`` once, silently)."""
    _exact(ProjectedPositions, n, 5, 3)


class Gate(nn.Module):
    """A leaf module without a closed-form rule (the generic one), with keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(H))

    def forward(self, x: Tensor, power: int = 1, shift: Tensor | None = None) -> Tensor:
        return torch.tanh(x * self.w**power) + (0 if shift is None else shift)


class GatedTable(nn.Module):
    """A relative position bias through the generic rule's module: run again per sample
    under ``vmap`` (its keyword arguments as they were)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias, self.gate = nn.Embedding(7, H), Gate()
        self.qk, self.head = nn.Linear(D, 2 * D), nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        pos = torch.arange(x.shape[1])
        b = self.gate(self.bias(pos[:, None] - pos[None, :] + 3), power=2, shift=None)
        attn = (_qk_scores(self.qk, x) + b.permute(2, 0, 1).unsqueeze(0)).softmax(-1)
        return self.head((attn.mean(1) @ x).mean(1))


@pytest.mark.filterwarnings("ignore::backprism.rules.generic.GenericRuleWarning")
@pytest.mark.parametrize("n", [3, 4])
def test_a_shared_value_through_a_module_of_the_generic_rule(n: int) -> None:
    _exact(GatedTable, n, 4, D)


class RelativeEmbeddings(nn.Module):
    """DeBERTa's disentangled attention: relative embeddings (an ``Embedding``'s weight used
    as a tensor) through a LayerNorm, a slice, dropout of its own (the same mask for every
    sample) and the key projection, laid out ``[H, 2S, d]`` and repeated over the batch folded
    with the heads (``repeat(N, 1, 1)`` to ``[N·H, 2S, d]``), in a batched matrix product with
    the per-sample queries, then gathered at each pair's relative position; the position
    queries are scaled in place (``/=``). ``mask``: the dropout mask to use instead of drawing
    one (the reference's)."""

    def __init__(self, s: int = 3, p: float = 0.0) -> None:
        super().__init__()
        self.s, self.p, self.mask = s, p, None
        self.tok, self.rel = nn.Linear(3, D), nn.Embedding(2 * s + 2, D)
        self.ln, self.q, self.k = nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, C)

    def heads(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        return x.view(n, t, H, D // H).permute(0, 2, 1, 3).contiguous().view(-1, t, D // H)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        h = self.tok(x)
        q = self.heads(self.q(h))  # [N·H, T, d]
        rel = self.ln(self.rel.weight)
        if self.mask is not None:
            rel = rel * self.mask
        elif self.p:
            rel = F.dropout(rel, self.p, self.training)
            self.drawn = (rel / self.ln(self.rel.weight)).detach()
        rel = rel[1 : 2 * self.s + 1].unsqueeze(0)
        pk = self.heads(self.k(rel)).repeat(q.shape[0] // H, 1, 1)  # [N·H, 2S, d]
        pq = self.heads(self.q(rel)).view(1, H, 2 * self.s, D // H)
        pq /= 2.0
        pos = torch.arange(t)
        index = (pos[:, None] - pos[None, :]).clamp(-self.s, self.s - 1) + self.s
        c2p = torch.gather(torch.bmm(q, pk.transpose(-1, -2)), -1, index.expand(n * H, t, t))
        keys = self.heads(h).view(n, H, t, D // H)
        p2c = torch.gather(keys @ pq.transpose(-1, -2), -1, index.expand(n, H, t, t))
        attn = (c2p.view(n, H, t, t) + p2c.transpose(-1, -2)).softmax(-1).mean(1)
        return self.head((attn @ h).mean(1))


@pytest.mark.parametrize("n", [3, 6])
def test_relative_embeddings_through_two_modules(n: int) -> None:
    """First order and the GGN diagonal against ``torch.func``, also where ``N = 2S`` (the
    number of relative positions) and ``N = T``."""
    _exact(RelativeEmbeddings, n, 6, 3)


CHAINS = {
    "coordinate_mlp": (lambda: CoordinateMlp(4), (4, D), "fc2"),
    "relative_embeddings": (RelativeEmbeddings, (6, 3), "k"),
}


@pytest.mark.parametrize("chain", CHAINS)
def test_a_chain_is_run_once_and_outside_collect_gives_the_plain_gradients(chain: str) -> None:
    """A shared value of modules in a row costs the forward one call of each module on the
    shared inputs (never one per sample: the copies are the output, copied); a backward pass
    that collects nothing gives the same ``.grad`` as the model that was never extended, with
    each parameter's own hook run once, over two steps."""
    make, shape, name = CHAINS[chain]
    torch.manual_seed(0)
    plain = make().to(DT)
    model = extend(make().to(DT))
    model.load_state_dict(plain.state_dict())
    seen: list[torch.Size] = []
    getattr(model, name).register_forward_hook(lambda m, a, o: seen.append(o.shape))
    runs = {"hook": 0}
    getattr(model, name).weight.register_hook(lambda g: runs.__setitem__("hook", runs["hook"] + 1))
    for step in range(2):
        x, y = torch.randn(3, *shape, dtype=DT), torch.randint(0, C, (3,))
        for m in (plain, model):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
        for (k, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=k)
        assert runs["hook"] == step + 1
    assert seen and all(s[0] != 3 or s == seen[0] for s in seen), seen
    assert len(set(seen)) == 1  # the shared shape, in the forward and its one re-run


def _hvp(
    m: nn.Module, x: Tensor, y: Tensor, vs: list[Tensor], first: Any = contextlib.nullcontext
) -> list[Tensor]:
    """Hessian-vector products of ``m``'s cross-entropy on ``(x, y)`` with ``vs``, by a
    ``create_graph=True`` backward (inside ``first()``) and a second backward, which must leave
    the random generator where it was."""
    ps = list(m.parameters())
    with first():
        gs = torch.autograd.grad(F.cross_entropy(m(x), y), ps, create_graph=True)
    state = torch.get_rng_state()
    hv = list(torch.autograd.grad(sum((g * v).sum() for g, v in zip(gs, vs)), ps))
    assert torch.equal(torch.get_rng_state(), state)
    return hv


@pytest.mark.parametrize("chain", CHAINS)
def test_double_backward_through_a_chain(chain: str) -> None:
    """``create_graph=True`` through widened chains (Hessian-vector products, gradient
    penalties): the same second derivatives as the model that was never extended, outside and
    inside ``collect`` (the GGN diagonal collected by the first backward pass)."""
    make, shape, _ = CHAINS[chain]
    torch.manual_seed(0)
    plain = make().to(DT)
    model = extend(make().to(DT))
    model.load_state_dict(plain.state_dict())
    x, y = torch.randn(3, *shape, dtype=DT), torch.randint(0, C, (3,))
    vs = [torch.randn_like(p) for p in plain.parameters()]
    expected = _hvp(plain, x, y, vs)
    for actual in (_hvp(model, x, y, vs), _hvp(model, x, y, vs, lambda: collect(DiagGGNExact()))):
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a, e, **TOL)


class NoisyScale(nn.Module):
    """A module with a parameter of its own that applies dropout in its forward; ``mask``: the
    mask to use instead of drawing one (the reference's), ``drawn``: the last one drawn outside
    ``vmap``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D) + 0.5)
        self.p, self.mask = p, None

    def forward(self, t: Tensor) -> Tensor:
        scaled = torch.tanh(t) * self.weight
        if self.mask is not None:
            return scaled * self.mask
        out = F.dropout(scaled, self.p, self.training)
        if not torch._C._functorch.is_batchedtensor(out):  # (not the re-run's, inside vmap)
            self.drawn = (out / scaled).detach()
        return out


class NoisyTable(nn.Module):
    """Position embeddings ``[T, d]`` (``[1, T, d]`` for ``batch_one``) through
    :class:`NoisyScale`, shared by all samples and added to their tokens."""

    def __init__(self, t: int, batch_one: bool) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(t)[None] if batch_one else torch.arange(t))
        self.pos, self.noisy = nn.Embedding(t, D), NoisyScale(0.5)
        self.tok, self.head = nn.Linear(3, D), nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        shared = self.noisy(self.pos(self.positions))
        return self.head(torch.tanh(self.tok(x) + shared).mean(1))


@pytest.mark.parametrize("batch_one", [False, True])
def test_double_backward_through_a_chain_that_draws_dropout(batch_one: bool) -> None:
    """A shared call with dropout of its own, re-run for ``create_graph=True``, draws the mask
    the forward drew (once for all samples): Hessian-vector products equal those of the model
    that was never extended with that mask fixed, and the random generator goes on from where
    it was. Inside ``collect`` the generic rule, which recomputes the call per sample, refuses
    it by name."""
    torch.manual_seed(0)
    plain = NoisyTable(3, batch_one).to(DT)
    model = extend(NoisyTable(3, batch_one).to(DT))
    model.load_state_dict(plain.state_dict())
    x, y = torch.randn(4, 3, 3, dtype=DT), torch.randint(0, C, (4,))
    vs = [torch.randn_like(p) for p in plain.parameters()]
    for _ in range(2):
        actual = _hvp(model, x, y, vs)
        drawn = model.noisy.drawn  # the mask of the extended forward
        assert 0 < drawn.count_nonzero() < drawn.numel()
        plain.noisy.mask = drawn
        for a, e in zip(actual, _hvp(plain, x, y, vs)):
            torch.testing.assert_close(a, e, **TOL)
    with pytest.raises(RuntimeError, match="NoisyScale draws random numbers"), collect(
        DiagGGNExact()
    ):
        F.cross_entropy(model(x), y).backward()


class WindowBias(nn.Module):
    """Swin-like: a relative position bias ``[1, H, T, T]`` (an ``Embedding`` of bucket
    indices) added to the scores of windows of ``T`` positions, the batch folded with the
    ``W`` windows (``[N·W, H, T, T]``), sample-major or window-major; with ``mask``, first
    combined with a constant ``[N·W, 1, T, T]`` mask (shifted windows)."""

    def __init__(self, w: int, t: int, mask: bool, major: str) -> None:
        super().__init__()
        self.w, self.t, self.major = w, t, major
        self.qk, self.head = nn.Linear(D, 2 * D), nn.Linear(D, C)
        self.bias = nn.Embedding(2 * t - 1, H)
        self.mask = torch.randn(w, 1, t, t, dtype=DT).clamp(max=0.0) if mask else None

    def rows(self, x: Tensor) -> Tensor:
        n, w, t = x.shape[0], self.w, self.t
        if self.major == "sample":
            return x.reshape(n * w, t, -1)
        return x.view(n, w, t, -1).transpose(0, 1).reshape(w * n, t, -1)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        q, k = self.qk(x).chunk(2, -1)  # [N, W·T, D] each
        q, k, v = self.rows(q), self.rows(k), self.rows(x)
        scores = (q.view(*q.shape[:2], H, -1).transpose(1, 2)
                  @ k.view(*k.shape[:2], H, -1).permute(0, 2, 3, 1))  # [N·W, H, T, T]
        pos = torch.arange(self.t)
        b = self.bias(pos[:, None] - pos[None, :] + self.t - 1).permute(2, 0, 1).unsqueeze(0)
        if self.mask is not None:
            m = self.mask.unsqueeze(0).expand(n, -1, -1, -1, -1).reshape(-1, 1, self.t, self.t)
            if self.major != "sample":
                m = self.mask.unsqueeze(1).expand(-1, n, -1, -1, -1).reshape(-1, 1, self.t, self.t)
            b = b + m
        out = ((scores + b).softmax(-1).mean(1) @ v).mean(1)  # [N·W, D]
        grouped = out.view(n, self.w, -1) if self.major == "sample" else (
            out.view(self.w, n, -1).transpose(0, 1)
        )
        return self.head(grouped.mean(1))


class MlpBias(WindowBias):
    """Swin V2's continuous position bias: an MLP (``Linear``, ``ReLU(inplace=True)`` or
    another activation, ``Linear``) on a constant table of relative coordinates, shared by all
    samples, then ``16·sigmoid`` and added to the windows' scores (``w = 1``: no fold), a
    projection on the windows' rows after the attention."""

    def __init__(self, w: int, t: int, act: nn.Module, sigmoid: bool = True) -> None:
        super().__init__(w, t, False, "sample")
        del self.bias
        self.sigmoid = sigmoid
        self.register_buffer("coords", torch.randn(2 * t - 1, 2, dtype=DT))
        self.mlp = nn.Sequential(nn.Linear(2, 5), act, nn.Linear(5, H))
        self.val = nn.Linear(D, D)
        self.proj = nn.Linear(D, D)  # (on the windows' rows: a call of batch N·W)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        q, k = self.qk(x).chunk(2, -1)
        q, k, v = self.rows(q), self.rows(k), self.rows(self.val(x))
        scores = (q.view(*q.shape[:2], H, -1).transpose(1, 2)
                  @ k.view(*k.shape[:2], H, -1).permute(0, 2, 3, 1))  # [N·W, H, T, T]
        pos = torch.arange(self.t)
        table = self.mlp(self.coords)  # [2T - 1, H]
        b = table[pos[:, None] - pos[None, :] + self.t - 1].permute(2, 0, 1)
        if self.sigmoid:
            b = 16 * torch.sigmoid(b)
        attn = (scores + b.unsqueeze(0)).softmax(-1).mean(1)
        out = self.proj(attn @ v).mean(1)  # [N·W, D]
        return self.head(out.view(n, self.w, -1).mean(1))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("w", [1, 3])
@pytest.mark.parametrize(
    "act", ["relu_inplace", "leaky_relu_inplace", "relu"], ids=lambda a: a
)
def test_an_mlp_on_a_shared_table_with_an_in_place_activation(w: int, act: str, n: int) -> None:
    """The shared MLP's activation written into its first layer's output (``nn.ReLU(inplace=
    True)``: ``F.relu(x, inplace=True)``, the flag passed by keyword or by position) is
    replayed on each sample's copy, so the first layer's per-sample gradients go through its
    mask (they were silently wrong — ``Σₙ grad_batch ≠ .grad`` — and a batch folded with
    windows was refused: the copies' value, computed from detached leaves, did not count as
    the same for every sample). Over windows (``w = 3``) the MLP runs on one copy per sample,
    repeated over the sample's windows; also for one sample (a rank's last batch)."""
    acts = {
        "relu_inplace": lambda: nn.ReLU(inplace=True),
        "leaky_relu_inplace": lambda: nn.LeakyReLU(0.1, inplace=True),
        "relu": nn.ReLU,
    }
    _exact(lambda: MlpBias(w, 2, acts[act]()), n, 2 * w, D)


class TableBias(MlpBias):
    """:class:`MlpBias` with the bias read from an ``Embedding`` of constant ids (a shared call
    without inputs that need gradients: copied by expansion), ``16·sigmoid`` of it or not."""

    def __init__(self, w: int, t: int, sigmoid: bool) -> None:
        super().__init__(w, t, nn.ReLU(), sigmoid)
        del self.mlp
        self.table = nn.Embedding(2 * t - 1, H)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        q, k = self.qk(x).chunk(2, -1)
        q, k, v = self.rows(q), self.rows(k), self.rows(self.val(x))
        scores = (q.view(*q.shape[:2], H, -1).transpose(1, 2)
                  @ k.view(*k.shape[:2], H, -1).permute(0, 2, 3, 1))
        pos = torch.arange(self.t)
        b = self.table(torch.arange(2 * self.t - 1))[pos[:, None] - pos[None, :] + self.t - 1]
        b = b.permute(2, 0, 1)
        if self.sigmoid:
            b = 16 * torch.sigmoid(b)
        attn = (scores + b.unsqueeze(0)).softmax(-1).mean(1)
        return self.head(self.proj(attn @ v).mean(1).view(n, self.w, -1).mean(1))


class NormedMlpBias(MlpBias):
    """:class:`MlpBias` whose second layer is a LayerNorm (on the first layer's output, which
    needs gradients: its copies are pulled back per sample), no sigmoid."""

    def __init__(self, w: int, t: int) -> None:
        super().__init__(w, t, nn.Identity(), False)
        self.mlp = nn.Sequential(nn.Linear(2, H), nn.LayerNorm(H))


@pytest.mark.parametrize("w", [1, 3])
@pytest.mark.parametrize(
    "make", ["table", "table_sigmoid", "linear_mlp", "tanh_mlp", "tanh_mlp_sigmoid", "norm_mlp"]
)
def test_diag_hessian_through_a_shared_table(make: str, w: int) -> None:
    """DiagHessian where a shared table meets the samples: exact through linear operations on
    it (views, an index) and through a Linear layer on a Linear layer's output (each copied
    over the samples, linear in its input); refused before anything is written where a
    nonlinear operation on the shared value (``16·sigmoid``, Swin V2's; a tanh between two
    layers) or a layer nonlinear in an input that needs gradients (a LayerNorm: its copies pull
    back each sample's gradient without its Hessian term) lies before the meeting — the copies
    replay them without their terms (silently wrong before the refusal: up to 15 % off)."""
    from backprism.engine.residual import NonlinearityError
    from backprism.extensions import DiagHessian
    from tests.reference import loss_hessian, split

    torch.manual_seed(0)
    model = {
        "table": lambda: TableBias(w, 2, False), "table_sigmoid": lambda: TableBias(w, 2, True),
        "linear_mlp": lambda: MlpBias(w, 2, nn.Identity(), False),
        "tanh_mlp": lambda: MlpBias(w, 2, nn.Tanh(), False),
        "tanh_mlp_sigmoid": lambda: MlpBias(w, 2, nn.Tanh()),
        "norm_mlp": lambda: NormedMlpBias(w, 2),
    }[make]().to(DT)
    x, y = torch.randn(3, 2 * w, D, dtype=DT), torch.randint(0, C, (3,))
    lossfunc = nn.CrossEntropyLoss()
    ref = split(torch.diagonal(loss_hessian(model, lossfunc, x, y)), model)
    extend(model)
    if make not in ("table", "linear_mlp"):
        with pytest.raises(NonlinearityError, match="all samples share"), collect(DiagHessian()):
            lossfunc(model(x), y).backward()
        assert_nothing_written(model, grad_too=True)
        return
    with collect(DiagHessian()):
        lossfunc(model(x), y).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, ref[k], **TOL, msg=k)


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("n", [2, 3])
def test_a_table_broadcast_over_windows_of_the_samples(n: int, mask: bool) -> None:
    """A shared bias widened over a batch folded sample-major with windows: each sample's
    rows summed, read from the scores it meets (after a constant mask, from the scores too);
    also where ``N = W``."""
    _exact(lambda: WindowBias(3, 2, mask, "sample"), n, 6, D)


@pytest.mark.parametrize("mask", [False, True])
def test_a_table_broadcast_over_window_major_rows_is_refused(mask: bool) -> None:
    """Window-major rows (``[W·N, …]``) group no sample's rows together: refused before
    anything is written. Every layer runs on ``N`` rows (the projections before the fold, the
    head after it, the table widened to ``N`` copies, each repeated over its sample's rows),
    so only the check of those rows' fold can tell. With the constant mask added first, the
    table is widened over the mask's ``W·N`` rows, a batch size no fold explains."""
    torch.manual_seed(0)
    model = extend(WindowBias(3, 2, mask, "window").to(DT))
    match = "batch sizes" if mask else "sample-major groups of 3"
    _refused(model, torch.randn(2, 6, D, dtype=DT), match)


def test_a_module_before_several_consumers_is_one_call() -> None:
    """DeBERTa's relative embeddings: one LayerNorm call feeds the key and the query
    projections, which widen it: it stays one call (widened once per forward), so the
    single-factor KFLR of its scale and shift, and of the embedding weight before it, is the
    exact GGN diagonal (the sum over several calls would not be)."""
    torch.manual_seed(0)
    model = RelativeEmbeddings().to(DT)
    with torch.no_grad():
        model.ln.weight.uniform_(0.5, 1.5)
        model.ln.bias.uniform_(-0.5, 0.5)
    x, y = torch.randn(3, 6, 3, dtype=DT), torch.randint(0, C, (3,))
    ref = batch_diag_ggn_loop(model, nn.CrossEntropyLoss(), x, y)
    extend(model)
    with collect(KFLR()):
        F.cross_entropy(model(x), y).backward()
    for k in ("ln.weight", "ln.bias", "rel.weight"):
        p = model.get_parameter(k)
        torch.testing.assert_close(
            torch.diagonal(p.kflr[0]), ref[k].sum(0).reshape(-1), **TOL, msg=k
        )


@pytest.mark.parametrize("kernel", ["add", "sdpa"])
def test_a_bias_shared_by_every_layer_is_one_call(kernel: str) -> None:
    """T5's relative position bias, computed once and met by every layer: one widened call
    (its copies serve all layers), so the single-factor KFLR of a table of the generic rule is
    the exact GGN diagonal."""
    torch.manual_seed(0)
    model = SharedBias("t5", kernel, 3, "generic").to(DT)
    x, y = torch.randn(3, 4, D, dtype=DT), torch.randint(0, C, (3,))
    ref = batch_diag_ggn_loop(model, nn.CrossEntropyLoss(), x, y)
    extend(model)
    with collect(KFLR()):
        F.cross_entropy(model(x), y).backward()
    for k in ("bias.w", "bias.s"):
        p = model.get_parameter(k)
        torch.testing.assert_close(
            torch.diagonal(p.kflr[0]), ref[k].sum(0).reshape(-1), **TOL, msg=k
        )


def test_dropout_of_a_shared_table() -> None:
    """In train mode the shared dropout mask is drawn once and replayed on every sample's copy:
    first order against the reference with the mask it drew."""
    torch.manual_seed(0)
    model = extend(RelativeEmbeddings(p=0.5).to(DT).train())
    x, y = torch.randn(4, 5, 3, dtype=DT), torch.randint(0, C, (4,))
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        F.cross_entropy(model(x), y).backward()
    assert (model.drawn == 0).any() and (model.drawn == 2).any()
    reference = RelativeEmbeddings(p=0.5).to(DT)
    reference.load_state_dict(model.state_dict())
    reference.mask = model.drawn
    assert_first_order(model, per_sample_grads(reference, nn.CrossEntropyLoss(), x, y), **TOL)


class InPlaceTable(nn.Module):
    """A relative position bias modified in place by an operation backprism does not replay
    on each sample's copy (``clamp_``): refused, also where ``T = N``."""

    def __init__(self) -> None:
        super().__init__()
        self.bias, self.qk, self.head = nn.Embedding(7, H), nn.Linear(D, 2 * D), nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        pos = torch.arange(x.shape[1])
        b = self.bias(pos[:, None] - pos[None, :] + 3).clone()  # [T, T, H]
        b.clamp_(-0.1, 0.1)
        attn = (_qk_scores(self.qk, x) + b.permute(2, 0, 1).unsqueeze(0)).softmax(-1)
        return self.head((attn.mean(1) @ x).mean(1))


@pytest.mark.parametrize("n", [3, 4])
def test_a_table_modified_in_place_otherwise_is_refused(n: int) -> None:
    torch.manual_seed(0)
    model = extend(InPlaceTable().to(DT))
    _refused(model, torch.randn(n, 4, D, dtype=DT), "in place by 'clamp_'")


class _ShapeOnly(nn.Embedding):
    """Hugging Face BART's learned positional embedding: the batched input ids are read for
    their shape only, the output ``[1, T, d]`` has no batch axis."""

    def forward(self, ids: Tensor, past: int = 0, position_ids: Tensor | None = None) -> Tensor:
        if position_ids is None:
            position_ids = torch.arange(past, past + ids.shape[1])
        return super().forward(position_ids.unsqueeze(0))


class _Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, D)
        self.pos = _ShapeOnly(6, D)
        self.head = nn.Linear(D, C)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos(ids, 0, position_ids=torch.arange(ids.shape[1]))
        return self.head(torch.tanh(h).mean(1))


def test_a_module_on_the_batch_without_it_in_its_output_is_refused() -> None:
    """A module called on the batch (ids ``[N, T]``) whose output ``[1, T, d]`` has no axis of
    ``N`` (BART's positional embedding) has no per-sample split: refused by name before
    anything is written (it failed with a bare autograd shape error); its parameter frozen, the
    rest is exact."""
    torch.manual_seed(0)
    model = _Positions().to(DT)
    X, y = torch.randint(0, 10, (3, 5)), torch.randint(0, C, (3,))
    lossfunc = extend(nn.CrossEntropyLoss())
    extend(model)
    refused = pytest.raises(RuntimeError, match=r"_ShapeOnly was called on 3 samples .* BART")
    with refused, collect(BatchGrad(), DiagGGNExact()):
        lossfunc(model(X), y).backward()
    assert_nothing_written(model)
    model.zero_grad()
    model.pos.weight.requires_grad_(False)
    ref = per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    with collect(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()):
        lossfunc(model(X), y).backward()
    assert_first_order(model, ref, **TOL)


@pytest.mark.parametrize("n", [1, 2])
def test_a_shared_mlp_over_windows_runs_on_one_copy_per_sample(n: int, monkeypatch) -> None:
    """Swin V2's position-bias MLP met by ``N·W`` window rows: its layers are widened to ``N``
    copies (each repeated over its sample's windows), not to one per window row — the cost of
    the shared layers' widened inputs and per-sample pull-backs does not grow with the windows.
    Exactness of that layout is checked by the tests above."""
    from backprism.engine import broadcast

    sizes: list[int] = []
    prepare = broadcast._Spread.prepare.__func__

    def spy(cls, module, live, copies, m, batch_one):
        sizes.append(m)
        return prepare(cls, module, live, copies, m, batch_one)

    monkeypatch.setattr(broadcast._Spread, "prepare", classmethod(spy))
    torch.manual_seed(0)
    model = extend(MlpBias(4, 2, nn.ReLU(inplace=True)).to(DT))
    x, y = torch.randn(n, 8, D, dtype=DT), torch.randint(0, C, (n,))
    with collect(BatchGrad()):
        F.cross_entropy(model(x), y).backward()
    assert sizes == [n]
    widths = {p.grad_batch.shape[0] for p in model.parameters()}
    assert widths == {n}
