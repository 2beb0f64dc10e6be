"""``python -m rootopt.train`` (e.g. under ``torchrun ... -m rootopt.train --config ...``)."""

from __future__ import annotations

from rootopt.train.main import main

raise SystemExit(main())
