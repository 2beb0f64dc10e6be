"""``DistributedROOT(fsdp_design="gram")`` under torchrun on gloo (tests/dist_scripts/gram.py):
matrices larger than a rank's share split over 2–4 holders (wide, tall, both at once with
overlapping holder sets, one with fewer rows than ranks so one shard is empty) give the
single-process update up to the order of the sums, on four option sets; the bytes and
collectives each rank issues are the cost model's ``gram`` prediction exactly; holders sit
on one node; no hidden ``full_tensor()``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from test_dist import results, run_ok

RUNS = [f"{c}/{o}" for c in ("wide", "tall", "both", "thin") for o in (
    "default", "bf16_iteration", "adanewton", "no_threshold"
)]  # fmt: skip
# which matrices each case splits (the rest stay whole), by world size: a matrix is split
# when it holds more than ceil(P / W) of the P parameter elements
SPLIT = {
    2: {"wide": 1, "tall": 1, "both": 0, "thin": 1},
    3: {"wide": 1, "tall": 1, "both": 2, "thin": 1},
    4: {"wide": 1, "tall": 1, "both": 2, "thin": 1},
}


def _check(res: list[dict[str, Any]], world: int, node: int) -> None:
    assert [r["world"] for r in res] == [world] * world
    for r in res:
        assert sorted(r["runs"]) == sorted(RUNS)
    for name in RUNS:
        case = name.split("/")[0]
        runs = [r["runs"][name] for r in res]
        for v in runs:
            assert sorted(v["param_diff"]) == sorted(v["move"])
            for n, d in v["param_diff"].items():
                # the reference moved every parameter far beyond the tolerance
                assert v["move"][n] > 1e-2, (name, n, v["move"][n])
                assert d <= 1e-6, (name, n, d)
            assert all(d == 0.0 for d in v["state_diff"].values()), (name, v["state_diff"])
            assert v["counted"]["full_tensor"] == 0
            # bytes: exactly the model's (up to float summation)
            for key, model in (("bytes_sent", "sent"), ("bytes_received", "received")):
                assert math.isclose(v["counted"][key], v["model"][model], rel_tol=1e-9), (
                    name, key, v["counted"][key], v["model"][model],
                )  # fmt: skip
        # every rank made the same holder groups, one per split matrix's holder set
        groups = runs[0]["groups"]
        assert all(v["groups"] == groups for v in runs)
        assert len(groups) == SPLIT[world][case], (name, groups)
        for hs in groups:
            assert len(set(hs)) == len(hs) >= 2
            assert len({h // node for h in hs}) == 1, (name, hs)  # one node
        # collectives: the busiest holder issues the model's count (each split matrix it
        # holds adds its quantile's and its iterations' all-reduces)
        assert max(v["counted"]["collectives"] for v in runs) == runs[0]["model"]["collectives"]
        if groups:
            assert runs[0]["model"]["notes"]


@pytest.mark.parametrize(("world", "node"), [(2, 0), (3, 0), (4, 0), (4, 2)])
def test_gram_design_matches_one_process_and_the_model(
    tmp_path: Path, world: int, node: int
) -> None:
    args = [str(tmp_path)] + ([str(node)] if node else [])
    run_ok("gram.py", world, *args)
    _check(results(tmp_path, "gram", world), world, node or world)
