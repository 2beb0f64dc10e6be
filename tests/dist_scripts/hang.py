"""One rank hangs (or dies) before a collective; the other must stop with one clear line
when the collective timeout (distributed.timeout_s) fires (or the connection drops).
Usage: hang.py OUT TIMEOUT_S [hang|die]."""

from __future__ import annotations

import os
import sys
import time

import torch
from common import HYPER, global_batch, groups, make_model, write

from rootopt.distributed import CollectiveError, DistributedROOT, abort, init_distributed, world


def main() -> int:
    out, timeout_s = sys.argv[1], float(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "hang"
    info = init_distributed(backend="gloo", timeout_s=timeout_s)
    model = make_model()
    opt = DistributedROOT(groups(model), average_grads=True, **HYPER)
    ids, x, y = global_batch(0)
    torch.nn.functional.mse_loss(model(ids, x), y).backward()
    if info.rank == info.world_size - 1:
        if mode == "die":
            os._exit(3)  # gone without a word
        time.sleep(10 * timeout_s)  # hung: never reaches the collective
        return 0
    start = time.monotonic()
    try:
        opt.step()
    except CollectiveError as exc:
        msg = str(exc)
        write(
            out,
            "hang",
            {
                "error": msg,
                "type": type(exc).__name__,
                "elapsed": time.monotonic() - start,
                "world": world().world_size,
            },
        )
        abort(exc)
    write(out, "hang", {"error": "", "type": "", "elapsed": time.monotonic() - start})
    return 0


if __name__ == "__main__":
    sys.exit(main())
