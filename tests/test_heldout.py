"""The held-out polar-error evaluation (``rootopt coeffs heldout``, rootopt_analysis.coeffs.heldout):
its error measure, its float32 and bfloat16 iterations, the recorder's capture of the
matrices ROOT orthogonalizes, AdaNewton through the optimizer's own path, the CLI's
handling of existing files, and the report in docs/adanewton.md against its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import rootopt
from rootopt import ROOT
from rootopt.coeffs import resolve
from rootopt.coeffs.presets import NAMED_SETS
from rootopt.optim.functional import outlier_threshold
from rootopt_analysis.coeffs import heldout as ho

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROOTOPT_CACHE_DIR", str(tmp_path / "cache"))


def _spiky(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A rank-3 signal over a floor ~1e-4 of it: a spiky spectrum."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(rows, 3, generator=g)
    v = torch.randn(3, cols, generator=g)
    return u @ v + 1e-4 * torch.randn(rows, cols, generator=g)


def _gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- error measure


def test_error_is_zero_for_an_orthogonal_input_and_its_svd_polar_factor():
    Q, _ = torch.linalg.qr(_gaussian(20, 12, 0).double())  # 20x12, orthonormal columns
    P, r = ho.polar_reference(Q.T.float())
    assert r == 12
    assert ho.relative_error(Q.T, P) < 1e-6  # the input was rounded to float32 once
    assert ho.relative_error(Q.T.double(), ho.polar_reference(Q.T)[0]) < 1e-13
    B = _gaussian(9, 14, 1)
    P, r = ho.polar_reference(B)
    assert r == 9
    assert ho.relative_error(P, P) == 0.0
    # P is the polar factor: orthonormal rows, and P Bᵀ symmetric positive definite.
    assert torch.allclose(P @ P.T, torch.eye(9, dtype=torch.float64), atol=1e-12)
    H = P @ B.double().T
    assert torch.allclose(H, H.T, atol=1e-10) and float(torch.linalg.eigvalsh(H).min()) > 0


def test_rank_deficient_reference_keeps_only_the_nonzero_singular_values():
    B = torch.zeros(8, 10)
    B[2:5] = _gaussian(3, 10, 2)  # exactly rank 3
    P, r = ho.polar_reference(B)
    assert r == 3
    assert float(torch.linalg.matrix_norm(P) ** 2) == pytest.approx(3.0, rel=1e-12)
    # Newton–Schulz drives 3 values to ~1 and leaves the zeros at 0: a small error, where
    # a full-rank reference would give sqrt(5/8) at best.
    err = ho.relative_error(ho.directions(B[None], "you", "float32")[0], P)
    assert err < 0.05


def _ns_float64(B: np.ndarray, schedule) -> np.ndarray:
    X = B / (np.linalg.norm(B) + 1e-7)
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


@pytest.mark.parametrize("name", ["muon", "you", "polar_express"])
def test_float32_iteration_matches_a_float64_reference(name):
    B = _gaussian(6, 10, 4)
    X = ho.directions(B[None], name, "float32")[0]
    ref = _ns_float64(B.double().numpy(), NAMED_SETS[name].schedule(ho.K))
    assert X.dtype == torch.float32
    assert np.abs(X.double().numpy() - ref).max() < 2e-6
    # ... and its error against the SVD polar factor is the float64 iteration's.
    P, _ = ho.polar_reference(B)
    assert ho.relative_error(X, P) == pytest.approx(
        ho.relative_error(torch.from_numpy(ref), P), rel=1e-4
    )


def test_float32_adanewton_matches_the_float64_iteration_with_the_shapes_schedule():
    """Every matrix of a shape, spiky or not, gets the shape's one resolved schedule: the
    table's, not a published one."""
    B = torch.stack([_spiky(12, 30, 5), _gaussian(12, 30, 6)])
    path = ho.optimizer_path("adanewton", "float32", 12, 30)
    assert path.certified and len(path.schedule) == ho.K
    assert [tuple(c) for c in path.schedule] == [
        tuple(c) for c in resolve("adanewton", 12, 30, ho.K)
    ]
    assert all(list(path.schedule) != list(s.schedule(ho.K)) for s in NAMED_SETS.values())
    X = ho.directions(B, "adanewton", "float32")
    assert X.shape == B.shape
    for x, b in zip(X, B, strict=True):
        ref = _ns_float64(b.double().numpy(), path.schedule)
        assert np.abs(x.double().numpy() - ref).max() < 1e-4


class _MatmulDtypes(TorchFunctionMode):
    """Records the dtypes of the tensor operands of every matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in ("matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm"):
            for a in args:
                if isinstance(a, torch.Tensor) and a.ndim >= 2:
                    self.seen.append((name, tuple(a.shape), a.dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["adanewton", "you"])
def test_bfloat16_evaluation_iterates_in_bfloat16(name):
    B = torch.stack([_gaussian(16, 40, 7), _spiky(16, 40, 8)])
    with _MatmulDtypes() as mode:
        X = ho.directions(B, name, "bfloat16")
    # Every product with the 16x40 iterate (one Gram matrix and one update per step)
    # ran in bfloat16.
    big = [(f, s, d) for f, s, d in mode.seen if s[-1] == 40]
    assert len(big) >= 2 * ho.K
    assert {d for _, _, d in big} == {torch.bfloat16}
    # The result holds bfloat16 numbers and is not the float32 iteration's.
    assert torch.equal(X, X.bfloat16().float())
    X32 = ho.directions(B, name, "float32")
    assert not torch.equal(X32, X32.bfloat16().float())
    assert 1e-4 < float((X - X32).abs().max()) < 0.2


def test_cans_is_refused_in_bfloat16_and_run_as_published():
    path = ho.optimizer_path("cans", "bfloat16", 16, 40)
    assert not path.certified and "refused" in path.resolved
    assert list(path.schedule) == list(NAMED_SETS["cans"].schedule(ho.K))
    assert ho.optimizer_path("cans", "float32", 16, 40).certified


# ------------------------------------------------------------------ the optimizer's path


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_adanewton_path_equals_the_optimizer_step(ns_dtype):
    """ROOT with lr 1, no decay, no lr scaling and parameters at 0 leaves ``p = −U``: the
    update direction of its step, which the evaluator must reproduce bit for bit for the
    ``B`` the step orthogonalized (spiky and Gaussian matrices; plain and Gram-space
    shapes)."""
    grads = [_spiky(24, 70, 9), _gaussian(24, 70, 10), _spiky(72, 160, 11).T]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt = ROOT(
        params,
        lr=1.0,
        weight_decay=0.0,
        lr_scale="none",
        ns_dtype=ns_dtype,
        ns_coefficients="adanewton",
    )
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    with ho.ns_inputs(calls):
        opt.step()
    assert [tuple(B.shape) for B, _ in calls] == [(2, 24, 70), (1, 160, 72)]
    steps = [-p.detach() for p in params]
    for (B, _U), want in zip(calls, [torch.stack(steps[:2]), steps[2][None]], strict=True):
        assert torch.equal(ho.directions(B, "adanewton", ns_dtype), want)


def test_adanewton_path_equals_orthogonalize():
    """The evaluator's AdaNewton is ``rootopt.orthogonalize``'s, bit for bit; the alias
    ``adanewton-static`` is not evaluated a second time."""
    B = torch.stack([_spiky(24, 70, 12), _gaussian(24, 70, 13)])
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        want = rootopt.orthogonalize(B, coefficients="adanewton", dtype=torch_dtype)
        assert torch.equal(ho.directions(B, "adanewton", dtype), want.float())
    assert ho.schedules() == ["adanewton", "muon", "you", "polar_express", "cans", "official"]


def test_wrapper_is_removed_after_capture():
    from rootopt.optim import functional

    before = functional.direction
    with pytest.raises(RuntimeError, match="boom"), ho.ns_inputs([]):
        assert functional.direction is not before
        raise RuntimeError("boom")
    assert functional.direction is before


def test_recorder_fails_loudly_when_the_core_call_is_gone(monkeypatch):
    from rootopt.optim import functional

    monkeypatch.delattr(functional, "direction")
    with pytest.raises(RuntimeError, match="must follow the optimizer's step"), ho.ns_inputs([]):
        pass


# ----------------------------------------------------------------------------- recorder


class _Net(nn.Module):
    """Two same-shape matrices (stacked by ROOT), one of another shape, a conv kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.a = nn.Linear(18, 12)
        self.b = nn.Linear(12, 12, bias=False)
        self.c = nn.Linear(12, 12, bias=False)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)[:, :18]
        return self.head(self.c(torch.tanh(self.b(torch.tanh(self.a(h))))))


def test_recorder_captures_the_clipped_momentum_of_every_root_matrix():
    torch.manual_seed(0)
    model = _Net()
    from rootopt import param_groups

    groups, _ = param_groups(model, lr=1e-2)
    opt = ROOT(groups, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 1, 5, 5, generator=g), torch.randint(0, 3, (8,), generator=g))]
    grads: dict[str, torch.Tensor] = {}

    def loss_fn(out, y):
        return nn.functional.cross_entropy(out, y)

    def batch(step):
        return data[0]

    # Step 1: buffer = g, Nesterov v = g + 0.95·g, B = clip(v at its 0.9-quantile).
    model.zero_grad()
    loss_fn(model(data[0][0]), data[0][1]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stacks, losses = ho.record_run(
        model, opt, batch, loss_fn, steps=2, capture=(1, 2), scheduler=None
    )
    assert len(losses) == 2
    root = {n: tuple(p.shape) for n, p in model.named_parameters() if p.ndim >= 2}
    root.pop("head.weight")  # routed to AdamW
    shapes = {
        "conv.weight": (4, 9),
        "a.weight": (12, 18),
        "b.weight": (12, 12),
        "c.weight": (12, 12),
    }
    assert set(root) == set(shapes)
    for step in (1, 2):
        got = {n: (s["rows"], s["cols"]) for s in stacks if s["step"] == step for n in s["names"]}
        assert got == shapes
    (bc,) = [s for s in stacks if s["step"] == 1 and s["rows"] == 12 and s["cols"] == 12]
    assert bc["names"] == ["b.weight", "c.weight"] and bc["B"].shape == (2, 12, 12)
    for s in (x for x in stacks if x["step"] == 1):
        for name, B in zip(s["names"], s["B"], strict=True):
            v = grads[name].reshape(B.shape)
            nesterov = torch.add(v, v, alpha=0.95)
            eps = outlier_threshold(nesterov, 0.9)
            torch.testing.assert_close(B, nesterov.clamp(-eps, eps), rtol=1e-6, atol=1e-7)
            assert not torch.equal(B, v * 1.95)  # the threshold clipped something


def test_record_task_digits_default_path(tmp_path):
    rec = ho.record_task("digits", seed=ho.DEFAULT_SEED, capture=(1, 3))
    model = ho.task_of("digits")[0].model()
    from rootopt.optim.functional import matrix_view

    want = {
        n: matrix_view(p.shape) for n, p in model.named_parameters() if "conv" in n and p.ndim == 4
    }
    assert {n for s in rec["stacks"] for n in s["names"]} == set(want)
    for s in rec["stacks"]:
        assert s["step"] in (1, 3)
        (name,) = s["names"]
        assert (s["rows"], s["cols"]) == (want[name].rows, want[name].cols)
        assert s["B"].shape == s["U"].shape == (1, s["rows"], s["cols"])
        assert torch.isfinite(s["B"]).all() and float(s["B"].abs().max()) > 0
    assert rec["provenance"]["steps"] == 3 and rec["seed"] == ho.DEFAULT_SEED


def test_unknown_task_is_one_line():
    with pytest.raises(ho.HeldoutError, match="unknown held-out task 'stdlib'"):
        ho.task_of("stdlib")
    assert ho.task_of("stdlib-large")[0].model().cfg.d_model == 128


# ----------------------------------------------------------------------------------- CLI


def test_cli_records_into_the_cache_and_reports(tmp_path, capsys):
    out_json = tmp_path / "summary.json"
    assert ho.main(["--tasks", "digits", "--steps", "1,2", "--json", str(out_json)]) == 0
    rec = tmp_path / "cache" / "heldout" / f"digits-seed{ho.DEFAULT_SEED}.pt"
    assert rec.is_file()
    s = json.loads(out_json.read_text())
    assert s["format"] == ho.SUMMARY_FORMAT and s["provenance"]["seed"] == ho.DEFAULT_SEED
    assert s["optimizer_check"] == {"stacks": 4, "identical": 4, "max_abs_diff": 0.0}
    assert s["schedules"] == ["adanewton", "muon", "you", "polar_express", "cans", "official"]
    # One AdaNewton schedule per shape: no per-matrix decisions are measured or reported.
    assert all(set(m["err"][d]) == set(s["schedules"]) for m in s["matrices"] for d in ho.DTYPES)
    assert not any("spiky" in m for m in s["matrices"]) and not any(
        "spiky" in g for g in s["groups"]
    )
    text = ho.render_markdown(s)
    head = [line for line in text.splitlines() if line.startswith("| task")]
    assert len(head) == 2 and all("spiky" not in h and "no selector" not in h for h in head)
    rows = [g for g in s["groups"] if g["dtype"] == "float32" and g["task"] == "digits"]
    assert sorted(g["shape"] for g in rows) == ["16x9", "32x144"] and all(g["n"] == 2 for g in rows)
    for g in s["groups"]:
        best = min(g["stats"][p]["median"] for p in s["published"])
        assert g["ratio_median"] == pytest.approx(g["stats"]["adanewton"]["median"] / best)
    assert s["certified"]["bfloat16"]["cans"] is False and s["certified"]["float32"]["cans"]
    assert text in capsys.readouterr().out
    # A second run reuses the recording (same bytes) and refuses to replace the JSON.
    before = rec.read_bytes()
    with pytest.raises(SystemExit) as exc:
        ho.main(["--tasks", "digits", "--steps", "1,2", "--json", str(out_json)])
    assert exc.value.code == 2
    assert ho.main(["--tasks", "digits", "--steps", "1,2"]) == 0
    assert rec.read_bytes() == before


def test_cli_refuses_files_it_does_not_own(tmp_path, capsys):
    out = tmp_path / "rec"
    out.mkdir()
    foreign = out / f"digits-seed{ho.DEFAULT_SEED}.pt"
    foreign.write_bytes(b"a user's file")
    assert ho.main(["--out", str(out), "--tasks", "digits", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a held-out recording" in err
    assert foreign.read_bytes() == b"a user's file"
    # A recording with other capture steps is not replaced either.
    foreign.unlink()
    assert ho.main(["--out", str(out), "--tasks", "digits", "--steps", "1"]) == 0
    mine = foreign.read_bytes()
    assert ho.main(["--out", str(out), "--tasks", "digits", "--steps", "1,2"]) == 2
    assert "other settings" in capsys.readouterr().err
    assert foreign.read_bytes() == mine
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    assert ho.main(["--out", str(a_file), "--tasks", "digits"]) == 2
    assert a_file.read_text() == "x"
    for bad in (["--steps", "0,5"], ["--steps", "a"], ["--tasks", "stdlib"]):
        with pytest.raises(SystemExit) as exc:
            ho.main(bad)
        assert exc.value.code == 2


# ------------------------------------------------------------------------------ the doc


def test_doc_table_is_generated_from_the_committed_summary():
    """docs/results/adanewton.md carries the tables of the committed held-out summary, and the
    summary says the optimizer's own directions were reproduced stack by stack."""
    record = json.loads((DOCS / "results" / "adanewton.json").read_text())
    run = record["runs"]["heldout"]
    summary = run["result"]
    assert summary["format"] == ho.SUMMARY_FORMAT
    doc = (DOCS / "results" / "adanewton.md").read_text()
    assert "## Matrices recorded from training" in doc
    assert ho.render_markdown(summary) in doc
    assert run["command"] in doc
    chk = summary["optimizer_check"]
    assert chk["identical"] == chk["stacks"] > 0
