"""``python -m rootopt.train`` (e.g. under ``torchrun ... -m rootopt.train --config ...``)."""

from __future__ import annotations

import sys

try:
    from rootopt.train.main import main
except KeyboardInterrupt:  # Ctrl-C while importing: one line, the SIGINT status
    print("rootopt train: interrupted while starting; nothing was written", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
