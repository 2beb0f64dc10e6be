"""Every path of the ROOT update against the per-matrix reference, on parameters and state.

The reference is :func:`rootopt.optim.functional._single_tensor_root` (the paper's update
written plainly, one matrix at a time), driven here with state kept as torch optimizers keep
it; the AdamW part is checked against ``torch.optim.AdamW``. Paths: the class's reference
loop (``batched=False``, bit for bit), the batched path (the default), small buckets (stacks
split and chunked), the whole step compiled (``compile_step=True``), ``DistributedROOT`` at
world size 1 (no process group), and at world size 2 replicated (``dist2``: the owner
design on gradients averaged by DDP; ``avg2``: the owner design reduce-scattering them
itself) and sharded (``DTensor``
parameters, as FSDP2 holds them; gloo, launched once by torchrun). Every path runs every
option set of ``tests/path_cases.py`` — the default coefficients (Muon's tuple) and
AdaNewton, float64 and bfloat16 parameters, Nesterov off, robust scaling, a bfloat16
iteration — on a model with fused QKV weights (``ns_split``, one of them stored transposed).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

from _faultkit import free_port
from path_cases import LR, OPTION_SETS, SHAPES, gradients, groups, iteration_dtype, make_params
from rootopt import ROOT
from rootopt.coeffs.cache import CoefficientCache
from rootopt.distributed import DistributedROOT
from rootopt.optim._options import ns_dtype_name
from rootopt.optim.functional import RootOptions, _single_tensor_root

ROOT_DIR = Path(__file__).resolve().parents[1]
Result = tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]

# ROOT's defaults, written out: the reference does not read them from the class (the
# iteration dtype is what ns_dtype="auto" resolves to on this CPU).
DEFAULTS: dict[str, Any] = dict(
    momentum=0.95, nesterov=True, weight_decay=0.1, outlier_quantile=0.9, ns_steps=5,
    ns_coefficients="muon", ns_dtype=ns_dtype_name("auto", torch.device("cpu")),
    robust_scaling=False, robust_window=100, robust_lambda=0.1,
)  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.promote_types(p.dtype, torch.float32)


@functools.cache
def reference(name: str) -> Result:
    options, dtype = OPTION_SETS[name]
    o = {**DEFAULTS, **options}
    params = make_params(dtype)
    cache = CoefficientCache()

    def coefficients(rows: int, cols: int) -> Any:
        return cache.schedule(o["ns_coefficients"], rows, cols, o["ns_steps"], o["ns_dtype"])

    adamw = [n for n, p in params.items() if p.ndim < 2]
    # torch's AdamW on float32 (or float64) copies, rounded back once per step: the
    # bfloat16 contract (state and arithmetic in float32, one rounding)
    masters = {n: nn.Parameter(params[n].detach().to(_state_dtype(params[n]))) for n in adamw}
    torch_adamw = torch.optim.AdamW(
        list(masters.values()), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
        foreach=False,
    )  # fmt: skip
    state: dict[str, dict[str, Any]] = {}
    for grads in gradients(dtype):
        for group in groups(params, options):
            opts = RootOptions(
                lr=LR, momentum=o["momentum"], nesterov=o["nesterov"],
                weight_decay=o["weight_decay"], quantile=o["outlier_quantile"],
                ns_dtype=DTYPES[o["ns_dtype"]], transposed=group.get("transposed", False),
                robust_window=o["robust_window"], robust_lambda=o["robust_lambda"],
            )  # fmt: skip
            for i, (n, p) in enumerate(zip(group["param_names"], group["params"])):
                if p.ndim < 2:
                    continue
                zeros = functools.partial(torch.zeros_like, p, dtype=_state_dtype(p))
                st = state.setdefault(n, {"step": torch.tensor(0.0), "momentum_buffer": zeros()})
                if o["robust_scaling"]:
                    st.setdefault("robust_mean", zeros())
                    st.setdefault("robust_sq", zeros())
                st["step"] += 1
                with torch.no_grad():
                    _single_tensor_root(
                        p, grads[n], st["momentum_buffer"], st["step"], opts, coefficients,
                        blocks=group["ns_split"][i] if "ns_split" in group else None,
                        robust=(st["robust_mean"], st["robust_sq"]) if o["robust_scaling"] else None,
                    )  # fmt: skip
        for n, m in masters.items():
            m.data.copy_(params[n].detach())
            m.grad = grads[n].to(m.dtype)
        torch_adamw.step()
        for n, m in masters.items():
            params[n].data.copy_(m.detach())
    for n, m in masters.items():
        state[n] = dict(torch_adamw.state[m])
    return {n: p.detach().clone() for n, p in params.items()}, state


def by_class(name: str, cls: type[ROOT] = ROOT, **path_options: Any) -> Result:
    options, dtype = OPTION_SETS[name]
    params = make_params(dtype)
    opt = cls(groups(params, options), lr=LR, **options, **path_options)
    for grads in gradients(dtype):
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
    state = {n: dict(opt.state[p]) for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}, state


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun launch (2 ranks, gloo) runs every option set, replicated and sharded."""
    out = tmp_path_factory.mktemp("paths")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT_DIR / "src"), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(ROOT_DIR / "tests" / "dist_scripts" / "paths.py"), str(out),
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT_DIR, env=env, capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish within 600 s (hang?)\n{exc.stdout!s:.4000}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return out


def by_path(path: str, name: str, request: pytest.FixtureRequest) -> Result:
    if path == "reference":
        return by_class(name, batched=False)
    if path == "batched":
        return by_class(name)
    if path == "buckets":  # two 24x40 matrices per stack: buckets split, the 3-stack chunked
        return by_class(name, bucket_bytes=24 * 40 * 4 * 2)
    if path in ("compiled", "inductor"):
        torch._dynamo.reset()
        if path == "inductor":
            return by_class(name, compile_step=True)
        # The whole step traced by Dynamo and AOTAutograd, run without Inductor's code
        # generation (minutes of C++ compiling on a CI machine; tests/test_compile.py
        # and the slow "inductor" cases compile for real).
        real = torch.compile
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "compile", functools.partial(real, backend="aot_eager"))
            return by_class(name, compile_step=True)
    if path == "dist1":
        return by_class(name, DistributedROOT)
    out = request.getfixturevalue("world2")
    mode = {"dist2": "replicated", "avg2": "averaged", "sharded": "sharded"}[path]
    saved = torch.load(out / f"{mode}-{name}.pt")
    assert saved["world"] == 2
    return saved["params"], saved["state"]


def _cases() -> list[Any]:
    cases = []
    paths = (
        "reference", "batched", "buckets", "compiled", "inductor", "dist1", "dist2", "avg2",
        "sharded",
    )  # fmt: skip
    for path in paths:
        for name, (options, _) in OPTION_SETS.items():
            if path == "sharded" and options.get("robust_scaling"):
                continue  # refused for sharded parameters (tests/test_dist.py)
            slow = path == "inductor"  # about 3 minutes of C++ compiling each
            cases.append(pytest.param(path, name, marks=[pytest.mark.slow] if slow else []))
    return cases


@pytest.mark.parametrize(("path", "name"), _cases())
def test_path_matches_the_reference(path: str, name: str, request: pytest.FixtureRequest) -> None:
    ref_params, ref_state = reference(name)
    got_params, got_state = by_path(path, name, request)
    options, dtype = OPTION_SETS[name]
    # the reference moved every parameter well beyond the tolerance
    init = make_params(dtype)
    assert min(float((ref_params[n] - init[n].detach()).abs().max()) for n in SHAPES) > 1e-2
    if path == "reference":
        tol: dict[str, float] = {"atol": 0.0, "rtol": 0.0}  # the same calls in the same order
    elif iteration_dtype(options) == "bfloat16":
        tol = {"atol": 2e-2, "rtol": 2e-2}  # bf16 iterations round at different places
    elif dtype == torch.bfloat16:
        tol = {"atol": 4e-3, "rtol": 0.0}  # at most one bf16 rounding step apart
    else:
        tol = {"atol": 1e-5, "rtol": 1e-5}
    assert sorted(got_params) == sorted(ref_params) == sorted(SHAPES)
    for n in SHAPES:
        assert got_params[n].dtype == dtype, n
        torch.testing.assert_close(got_params[n], ref_params[n], **tol, msg=f"param {n}")
        assert sorted(got_state[n]) == sorted(ref_state[n]), n
        for key, want in ref_state[n].items():
            have = got_state[n][key]
            assert torch.is_tensor(have), (n, key)
            if key == "step":
                assert float(have) == float(want) == 3.0, (n, key)
                continue
            assert have.dtype == want.dtype == _state_dtype(init[n]), (n, key, have.dtype)
            # momentum and moments see only gradients; rounding of the sums at most
            torch.testing.assert_close(have, want, atol=1e-6, rtol=1e-6, msg=f"{n}:{key}")


def test_orthogonalize_is_the_step_direction() -> None:
    """``rootopt.orthogonalize(G)`` with the default coefficients is the direction the
    optimizer applies for a gradient ``G`` with the threshold off: zero momentum and
    decay, unscaled lr 1, so the step moves a zero parameter by exactly ``-U``, in either
    iteration dtype."""
    from rootopt import orthogonalize

    g = torch.Generator().manual_seed(3)
    for shape in [(24, 40), (40, 24), (64, 160), (7, 13)]:
        G = torch.randn(shape, generator=g)
        G[: shape[0] // 4] *= 30  # a few large rows: a spiky spectrum
        for dtype in ("float32", "bfloat16"):
            p = nn.Parameter(torch.zeros(shape))
            opt = ROOT(
                [p], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0, lr_scale="none",
                outlier_quantile=None, ns_dtype=dtype,
            )  # fmt: skip
            p.grad = G.clone()
            opt.step()
            # The batched step iterates on a stack of one: the same call, bit for bit.
            U3 = orthogonalize(G[None], dtype=DTYPES[dtype])[0]
            assert torch.equal(-p.detach(), U3.float()), shape
            # A 2-D matrix runs mm instead of bmm: equal up to their float32 rounding
            # (tens of ulps after K = 5 steps on 7x13).
            U = orthogonalize(G, dtype=DTYPES[dtype])
            torch.testing.assert_close(-p.detach(), U.float(), atol=1e-5, rtol=0, msg=str(shape))
