"""rootopt.distributed.split under torchrun on gloo (tests/dist_scripts/split.py): a matrix
held as column slabs on 2 and 3 ranks (uneven, one slab empty at 3) gives the same
quantile as abs_quantile on the whole matrix, bit for bit, and the same Newton–Schulz
iterate as newton_schulz up to the order of the sums."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_dist import results, run_ok


@pytest.mark.parametrize("world", [2, 3])
def test_split_matrix_quantile_and_newton_schulz_equal_one_process(
    tmp_path: Path, world: int
) -> None:
    run_ok("split.py", world, str(tmp_path))
    res = results(tmp_path, "split", world)
    assert [r["world"] for r in res] == [world] * world
    for r in res:
        assert len(r["quantile"]) == 6 * 6
        for case, v in r["quantile"].items():
            assert v["equal"], (case, v)
        assert r["nan_error"] == "split_abs_quantile of a matrix with NaN entries"
        assert sorted(r["ns"]) == ["bfloat16", "float32", "float64"]
        for name, tol in (("float64", 1e-12), ("float32", 2e-5), ("bfloat16", 0.1)):
            ns = r["ns"][name]
            assert ns["shape"] == [24, 100] and ns["dtype"] == f"torch.{name}"
            assert ns["max_diff"] <= tol * ns["ref_max"], (name, ns)
            assert 0.5 < ns["sv"][1] <= ns["sv"][0] < 1.5, (name, ns)
    # every rank got the same answers
    assert all(r["quantile"] == res[0]["quantile"] for r in res)
