"""The commands that read a finished run: ``rootopt export``
(:mod:`~rootopt.train.tools.export`) and ``rootopt diagnose``
(:mod:`~rootopt.train.tools.diagnose`), called from :mod:`rootopt.commands`.

A training run never imports them.
"""
