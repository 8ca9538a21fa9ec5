"""Peers benchmark: backprism next to Opacus, ``torch.func`` and curvlinops, as ratios to a plain
forward+backward measured in the same run, with peak memory.

Usage::

    python benchmarks/bench_peers.py                                  # transformer resnet18 gpt2
    python benchmarks/bench_peers.py --problems transformer --repeats 5 --threads 1
    python benchmarks/bench_peers.py --problems gpt2 --n 64 --generic  # + the generic-rule rows
    python benchmarks/bench_peers.py --markdown --problems transformer --n 32
    PYTHONPATH=/path/to/other/src python benchmarks/bench_peers.py     # another backprism

Problems: ``transformer`` and ``resnet18`` from ``problems.py`` and ``gpt2``, a GPT-2-shaped
decoder from a Hugging Face ``GPT2Config`` (2 layers, 4 heads, d = 64, T = 32, 2048-token
vocabulary, head tied to the token embedding, next-token cross-entropy over ``[N, V, T]``).
Not in the default list (``--problems timm_resnet18 timm_convnext timm_vit``): timm models from
``timm.create_model(name, pretrained=False, num_classes=10)`` in eval mode on 3×32×32 inputs —
``resnet18``, ``convnext_atto`` and ``vit_tiny_patch16_224`` with ``img_size=32, patch_size=4``
(:func:`problems.import_timm` first makes a CUDA torchvision build importable beside a CPU torch).

Configurations (each on its own copy of the model, same weights and data):

* ``plain`` — ``loss.backward()``; every ratio is to its median in the same run;
* ``backprism <Extension>`` — one extension inside ``collect``; ``--generic`` adds the same with
  the attention / ``Conv1D`` / HF-norm rules switched off (what the generic ``torch.func`` rule
  costs, i.e. the state before those rules);
* ``backprism KFAC (Linear/Conv)`` — ``KFAC(kfac_approx="expand")`` with only ``nn.Linear`` /
  ``nn.Conv2d`` parameters trainable (what curvlinops supports), next to ``curvlinops KFAC
  (Linear/Conv)`` (``KFACLinearOperator(..., kfac_approx="expand").compute_kronecker_factors()``,
  MC Fisher, one sample): the same factors over positions;
* ``opacus GradSampleModule`` — per-sample gradients (``p.grad_sample``) on
  ``ModuleValidator.fix(model)`` (``nn.MultiheadAttention`` → ``DPMultiheadAttention``,
  BatchNorm → GroupNorm), ``opacus plain (fixed model)`` its plain step for reference;
* ``opacus ghost clipping`` — ``GradSampleModuleFastGradientClipping(use_ghost_clipping=True)``:
  per-sample gradient norms from one backward pass (the clipped second pass is not timed);
* ``torch.func vmap`` — ``vmap(grad(loss of one sample))`` over the batch (attention through
  SDPA's math backend, which has batching rules);
* ``curvlinops GGN-vp`` — one GGN-vector product of the whole batch
  (``GGNLinearOperator @ v``, all parameters; SDPA's math backend, which has forward-mode AD).

Timing: ``--threads`` (default 2), one warm-up round, then ``--repeats`` rounds in which all
configurations run in turn; medians. Memory (``measure.peak_memory``, the same definition on
every device and in every benchmark script): in this process after the timings, one more
warm-up step of each configuration and then the peak bytes held by tensors during one step
above what they held when it started (from the profiler's allocation events); reported is the
configuration's minus the plain step's, in MiB. ``--markdown`` prints one GitHub markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(__file__))
from measure import mib, mib_cell, peak_memory, print_markdown
from problems import build, describe, import_transformers

EXTENSIONS = ["BatchL2Grad", "SumGradSquared", "Variance", "BatchGrad", "DiagGGNMC", "KFAC"]
#: the targets of the issue (CPU, N = 128, transformer and resnet18)
TARGETS = {
    "BatchL2Grad": 1.4, "SumGradSquared": 1.6, "Variance": 1.6, "BatchGrad": 1.8,
    "DiagGGNMC": 2.0, "KFAC": 2.5, "KFAC (Linear/Conv)": 2.5,
}
FIELDS = {
    "BatchL2Grad": "batch_l2", "SumGradSquared": "sum_grad_squared", "Variance": "variance",
    "BatchGrad": "grad_batch", "DiagGGNMC": "diag_ggn_mc", "KFAC": "kfac",
}
#: rule classes switched off by --generic (their modules then take the generic rule)
NEW_RULES = ("MultiheadAttentionRule", "Conv1DRule", "ScaledNormRule")


# -- problems ------------------------------------------------------------------------------------
class LMLogits(nn.Module):
    """A Hugging Face causal LM as a module returning logits ``[N, V, T]``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx).logits.transpose(1, 2)


def gpt2(n: int, seq: int = 32, vocab: int = 2048, d: int = 64, layers: int = 2, heads: int = 4):
    transformers = import_transformers()
    cfg = transformers.GPT2Config(
        n_layer=layers, n_head=heads, n_embd=d, vocab_size=vocab, n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LMLogits(transformers.GPT2LMHeadModel(cfg))
    X, y = torch.randint(0, vocab, (n, seq)), torch.randint(0, vocab, (n, seq))
    return model, nn.CrossEntropyLoss(), X, y


def make_problem(name: str, n: int):
    torch.manual_seed(0)
    if name == "gpt2":
        return gpt2(n)
    return build(name, n)


def _contiguous_positions(model: nn.Module) -> None:
    """Opacus' ghost-clipping embedding norms need contiguous ids: the benchmark transformer
    feeds ``arange(T).expand(N, T)``; give it a contiguous copy (same numbers)."""
    if type(model).__name__ != "_TinyTransformer":
        return

    def forward(self, tokens: Tensor) -> Tensor:
        n, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).expand(n, t).contiguous()
        h = self.emb(tokens) + self.pos(pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))

    model.forward = types.MethodType(forward, model)


# -- runners -------------------------------------------------------------------------------------
class NotApplicable(Exception):
    """A configuration that does not apply to a problem (the row's note gives the reason)."""


class Runner:
    def __init__(self, run: Callable[[], None], clear: Callable[[], None]) -> None:
        self.run, self.clear = run, clear

    def __call__(self) -> None:
        self.clear()
        self.run()


@contextlib.contextmanager
def generic_rules():
    """The rules of :data:`NEW_RULES` unregistered (their modules take the generic rule)."""
    from backprism.engine import rule as R

    saved = {t: r for t, r in R._REGISTRY.items() if type(r).__name__ in NEW_RULES}
    for t in saved:
        del R._REGISTRY[t]
    try:
        yield
    finally:
        R._REGISTRY.update(saved)


def _freeze_except_linear_conv(model: nn.Module) -> list[nn.Parameter]:
    keep = {
        id(p)
        for m in model.modules()
        if type(m) in (nn.Linear, nn.Conv2d) and _is_called(model, m)
        for p in m.parameters(recurse=False)
    }
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return [p for p in model.parameters() if p.requires_grad]


def _is_called(model: nn.Module, m: nn.Module) -> bool:
    """``MultiheadAttention.out_proj`` is a Linear used functionally (never called)."""
    return not any(isinstance(parent, nn.MultiheadAttention) for parent in model.modules()
                   if any(c is m for c in parent.children()))


def _clear_fields(model: nn.Module, fields: tuple[str, ...]) -> Callable[[], None]:
    params = list(model.parameters())

    def clear() -> None:
        model.zero_grad(set_to_none=True)
        for p in params:
            for f in fields:
                if f in p.__dict__:
                    delattr(p, f)

    return clear


def make_runner(problem: str, tool: str, method: str, n: int) -> Runner | None:
    model, lossfunc, X, y = make_problem(problem, n)
    if tool == "plain":
        if method == "opacus model":
            from opacus.validators import ModuleValidator

            model = ModuleValidator.fix(model).train()

        def run() -> None:
            lossfunc(model(X), y).backward()

        return Runner(run, _clear_fields(model, ()))
    if tool in ("backprism", "backprism-generic"):
        import backprism
        from backprism import extensions as E

        name = "KFAC" if method == "KFAC (Linear/Conv)" else method
        if method == "KFAC (Linear/Conv)":
            _freeze_except_linear_conv(model)
        backprism.extend(model)
        lf = backprism.extend(lossfunc)
        ext = getattr(E, name)
        if method == "KFAC (Linear/Conv)":  # curvlinops' convention over positions
            ext = functools.partial(E.KFAC, kfac_approx="expand")
        ctx = generic_rules if tool == "backprism-generic" else contextlib.nullcontext

        def run() -> None:
            with ctx(), backprism.collect(ext()):
                lf(model(X), y).backward()

        return Runner(run, _clear_fields(model, (FIELDS[name],)))
    if tool == "opacus":
        from opacus import GradSampleModule
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.validators import ModuleValidator

        # BatchNorm → GroupNorm; train mode, since Opacus records activations only there
        # (the benchmark models have no dropout, and no BatchNorm is left)
        model = ModuleValidator.fix(model).train()
        if method == "ghost clipping":
            _contiguous_positions(model)
            gsm = GradSampleModuleFastGradientClipping(
                model, batch_first=True, loss_reduction="mean", strict=False,
                use_ghost_clipping=True,
            )

            def run() -> None:
                lossfunc(gsm(X), y).backward()
                gsm.get_norm_sample()

            return Runner(run, _clear_fields(gsm, ("_norm_sample",)))
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=False)

        def run() -> None:
            lossfunc(gsm(X), y).backward()

        def clear() -> None:
            gsm.zero_grad(set_to_none=True)  # opacus drops grad_sample too
            for p in gsm.parameters():
                p.grad_sample = None

        return Runner(run, clear)
    if tool == "torch.func":
        from torch.func import functional_call, grad, vmap
        from torch.nn.attention import SDPBackend, sdpa_kernel

        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        out: dict = {}

        def loss_one(p: dict, x: Tensor, t: Tensor) -> Tensor:
            return lossfunc(functional_call(model, (p, buffers), (x[None],)), t[None])

        def run() -> None:
            with sdpa_kernel(SDPBackend.MATH):
                out["g"] = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, X, y)

        return Runner(run, lambda: out.clear())
    if tool == "curvlinops":
        from curvlinops import GGNLinearOperator, KFACLinearOperator

        if method == "KFAC (Linear/Conv)":
            if problem == "gpt2":
                raise NotApplicable("curvlinops' KFAC has no Hugging Face Conv1D")
            params = _freeze_except_linear_conv(model)

            def run() -> None:
                op = KFACLinearOperator(
                    model, lossfunc, params, [(X, y)], check_deterministic=False,
                    fisher_type="mc", mc_samples=1, kfac_approx="expand",
                )
                op.compute_kronecker_factors()

            return Runner(run, lambda: None)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        params = [p for p in model.parameters() if p.requires_grad]
        op = GGNLinearOperator(model, lossfunc, params, [(X, y)], check_deterministic=False)
        v = torch.randn(sum(p.numel() for p in params))
        res: dict = {}

        def run() -> None:
            with sdpa_kernel(SDPBackend.MATH):  # forward-mode AD: no fused CPU kernel
                res["v"] = op @ v

        return Runner(run, lambda: res.clear())
    raise ValueError(tool)


#: tools to run (``--tools``); ``None``: all
TOOLS: list[str] | None = None


def configurations(problem: str, generic: bool) -> list[tuple[str, str]]:
    configs = _configurations(problem, generic)
    if TOOLS is None:
        return configs
    return [c for c in configs if c == ("plain", "step") or c[0] in TOOLS]


def _configurations(problem: str, generic: bool) -> list[tuple[str, str]]:
    configs = [("plain", "step")]
    configs += [("backprism", m) for m in EXTENSIONS]
    if problem != "gpt2":
        configs.append(("backprism", "KFAC (Linear/Conv)"))
    if generic and problem in ("transformer", "gpt2"):
        configs += [("backprism-generic", m) for m in EXTENSIONS if m != "KFAC"]
    configs += [
        ("plain", "opacus model"),
        ("opacus", "GradSampleModule"),
        ("opacus", "ghost clipping"),
        ("torch.func", "vmap per-sample grads"),
        ("curvlinops", "KFAC (Linear/Conv)"),
        ("curvlinops", "GGN-vp"),
    ]
    return configs


# -- measuring -----------------------------------------------------------------------------------
def _runners(problem: str, n: int, generic: bool, errors: dict) -> dict[tuple[str, str], Runner]:
    runners: dict[tuple[str, str], Runner] = {}
    for key in configurations(problem, generic):
        try:
            r = make_runner(problem, *key, n)
        except Exception as err:  # a peer that cannot run this model
            errors[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
            continue
        if r is not None:
            runners[key] = r
    return runners


def measure_memory(runners: dict[tuple[str, str], Runner]) -> dict[tuple[str, str], int]:
    """Per configuration: one step's peak memory above its starting point, in bytes
    (``measure.peak_memory``, one warm-up step); configurations that fail are left out."""
    out = {}
    for key, r in runners.items():
        with contextlib.suppress(Exception):
            out[key] = peak_memory(r.run, "cpu", r.clear)
        r.clear()
    return out


def bench(problem: str, n: int, repeats: int, generic: bool, memory: bool) -> list[dict]:
    errors: dict[tuple[str, str], str] = {}
    runners = _runners(problem, n, generic, errors)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in runners}
    for rnd in range(repeats + 1):
        for key, r in list(runners.items()):
            gc.collect()
            t0 = time.perf_counter()
            try:
                r()
            except Exception as err:
                errors[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
                del runners[key], times[key]
                continue
            if rnd:
                times[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    peaks = measure_memory(runners) if memory else {}
    del runners
    gc.collect()
    plain = med.get(("plain", "step"))  # None: the problem itself failed (see the notes)
    base = peaks.get(("plain", "step"))
    rows = []
    for key in configurations(problem, generic):
        peak = peaks.get(key)
        rows.append({
            "problem": problem, "tool": key[0], "method": key[1], "n": n,
            "seconds": med.get(key),
            "ratio": med[key] / plain if key in med and plain else None,
            "mib": mib(peak - base) if peak is not None and base is not None else None,
            "peak_mib": mib(peak),
            "error": errors.get(key),
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", nargs="+", default=["transformer", "resnet18", "gpt2"])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--generic", action="store_true",
                    help="also time backprism with the attention/Conv1D/HF-norm rules off")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--tools", nargs="+", help="only these tools (backprism, backprism-generic, "
                    "opacus, torch.func, curvlinops, plain)")
    ap.add_argument("--markdown", action="store_true", help="print one GitHub markdown table")
    args = ap.parse_args(argv)
    global TOOLS
    TOOLS = args.tools
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import backprism

    settings = f"N={args.n}, repeats={args.repeats}"
    if not args.markdown:
        where = os.path.dirname(backprism.__file__)
        print(f"{settings}, {describe('cpu')}, backprism from {where}")
    all_rows = []
    for problem in args.problems:
        rows = bench(problem, args.n, args.repeats, args.generic, not args.no_memory)
        all_rows += rows
        if args.markdown:
            continue
        plain = rows[0]["seconds"]
        peak = rows[0]["peak_mib"]
        if plain is None:
            print(f"\n{problem}: {rows[0]['error']}")
            continue
        print(f"\n{problem} (plain step {plain:.3f} s"
              + (f", peak {peak:.0f} MiB)" if peak is not None else ")"))
        print(f"  {'tool':<18} {'method':<24} {'ratio':>7} {'target':>7} {'+MiB':>7}")
        for r in rows[1:]:
            target = TARGETS.get(r["method"]) if r["tool"] == "backprism" else None
            ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
            mem = mib_cell(r["mib"]) or "-"
            tgt = f"{target:.1f}x" if target and problem != "gpt2" else ""
            line = f"  {r['tool']:<18} {r['method']:<24} {ratio:>7} {tgt:>7} {mem:>7}"
            if r["error"]:
                line += f"   ({r['error']})"
            print(line, flush=True)
    if args.markdown:
        _print_markdown(all_rows, settings, not args.no_memory)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)


def _print_markdown(rows: list[dict], settings: str, memory: bool) -> None:
    headers = ["problem", "tool", "method", "ratio", "target"]
    headers += ["+MiB"] if memory else []
    headers += ["note"]
    table = []
    for r in rows:
        if r["tool"] == "plain" and r["method"] == "step":
            secs = f"{r['seconds']:.3f} s" if r["seconds"] is not None else None
            cells = [r["problem"], "*plain step*", "", secs, ""]
            peak = r["peak_mib"]
            cells += [mib_cell(peak, " peak")] if memory else []
            table.append([*cells, r["error"] or ""])
            continue
        target = TARGETS.get(r["method"]) if r["tool"] == "backprism" else None
        cells = [
            r["problem"], r["tool"], r["method"],
            f"{r['ratio']:.2f}x" if r["ratio"] is not None else None,
            f"{target:.1f}x" if target and r["problem"] != "gpt2" else "",
        ]
        if memory:
            cells.append(mib_cell(r["mib"]))
        table.append([*cells, r["error"] or ""])
    notes = ["ratio: median step time over the plain step's median in the same rounds; target: "
             "the issue's goal for backprism (CPU, N = 128, transformer and resnet18)",
             "what a row's time contains: backprism and Opacus rows are a training step (the "
             "gradient and the quantity from one backward pass); `torch.func` vmap gives the "
             "per-sample gradients only (`.grad` is their sum); curvlinops KFAC computes the "
             "factors only, with its own forward and backward of sampled gradients, so a "
             "training step with them costs 1 + its ratio; curvlinops GGN-vp is one product"]
    if memory:
        notes.append("+MiB: the step's peak memory above its starting point minus the plain "
                     "step's (`measure.peak_memory`); the plain row gives its own peak in MiB")
    print_markdown(headers, table, settings, "cpu", align="lllrrrl"[: len(headers) - 1] + "l",
                   notes=notes)


if __name__ == "__main__":
    main()
