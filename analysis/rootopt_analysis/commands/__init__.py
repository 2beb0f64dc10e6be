"""The analysis commands of the ``rootopt`` CLI (``bench``, ``plan`` and every ``coeffs``
subcommand but ``show``); :mod:`rootopt.cli` routes to them."""
