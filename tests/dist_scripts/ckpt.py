"""Cross-world-size checkpoint step: load the newest checkpoint (if any), check it against
the single-process reference, train, save. Usage: ckpt.py OUT CKPT_DIR LAYOUT STEPS.

LAYOUT: ``none``, ``ddp``, ``fsdp`` (wrap_model's modes) or ``owner`` (no wrapper; the
optimizer reduce-scatters the gradients to their owners, ``average_grads=True``)."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from common import HYPER, global_batch, groups, make_model, write
from parity import full, full_state, reference

from rootopt.distributed import DistributedROOT, finish, init_distributed, unwrap_model, wrap_model
from rootopt.distributed import checkpoint as dck
from rootopt.train.checkpoint import newest_valid


def compare(model: torch.nn.Module, opt: DistributedROOT, step: int) -> dict[str, float]:
    ref_params, ref_state, _ = reference(step)
    named = dict(unwrap_model(model).named_parameters())
    pd = max(float((full(named[n]).detach() - ref_params[n]).abs().max()) for n in ref_params)
    sd = 0.0
    steps_equal = True
    state = full_state(opt, unwrap_model(model))  # the owner design's, gathered
    for n, st in ref_state.items():
        for k, v in st.items():
            got = state[n][k]
            if isinstance(v, torch.Tensor):
                sd = max(sd, float((full(got) - v).abs().max()))
            else:
                steps_equal &= got == v
    return {"param_diff": pd, "state_diff": sd, "steps_equal": float(steps_equal)}


def run(out_dir: str, ck_dir: str, layout: str, steps: int) -> dict[str, Any]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mode = "none" if layout == "owner" else layout
    model = wrap_model(make_model(), mode, find_unused_parameters=True)  # type: ignore[arg-type]
    kw: dict[str, Any] = {"average_grads": True} if layout == "owner" else {}
    opt = DistributedROOT(groups(unwrap_model(model)), **HYPER, **kw)
    res: dict[str, Any] = {"world": world, "layout": layout}
    start = 0
    found, _ = newest_valid(ck_dir)
    if found is not None:
        start, extra = dck.load(found.path, model, opt)
        res["loaded_step"] = start
        res["extra_ok"] = float(extra.get("data_step") == start)
        res["after_load"] = compare(model, opt, start)
    for step in range(start, start + steps):
        ids, x, y = global_batch(step)
        sl = torch.tensor_split(torch.arange(ids.numel()), world)[rank]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids[sl], x[sl]), y[sl]).backward()
        opt.step()
    end = start + steps
    res["after_train"] = compare(model, opt, end)
    saved = dck.save(
        ck_dir, end, model, opt, extra={"data_step": end, "rng": torch.get_rng_state()}
    )
    res["saved"] = saved.name
    return res


if __name__ == "__main__":
    out, ck, layout, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    init_distributed(backend="gloo", timeout_s=120)
    res = run(out, ck, layout, steps)
    write(out, f"ckpt-{res['saved']}", res)
    finish(0)
