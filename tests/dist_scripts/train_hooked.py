"""``python -m rootopt.train`` under torchrun with a fault injected on one rank, for the
integrity tests. Usage: train_hooked.py SPEC_JSON, SPEC = {"argv": [...], "die_rank": r,
"die_in_save_at": step}: rank ``die_rank`` SIGKILLs itself inside the collective save of
checkpoint ``step`` (after the save has started on every rank, before it writes its part)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys

from torch.distributed.checkpoint import filesystem

from rootopt.train.main import main

spec = json.loads(sys.argv[1])
rank = int(os.environ.get("RANK", "0"))
if rank == spec.get("die_rank", -1):
    real_write = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        m = re.search(r"dcp-(\d{8})", str(self.path))
        if m and int(m.group(1)) == spec["die_in_save_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data  # type: ignore[method-assign]

sys.exit(main(spec["argv"]))
