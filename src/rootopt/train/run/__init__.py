"""A run as the loop and its components share it (docs/training.md, "The run directory").

- :mod:`~rootopt.train.run.state`: what a run is made of (:class:`~rootopt.train.run.state.Run`),
  where it is (:class:`~rootopt.train.run.state.TrainState`) and its extension points.
- :mod:`~rootopt.train.run.directory`: the run directory's default name, who may write into
  it, its lock and the files it holds.
- :mod:`~rootopt.train.run.summary`: the session's result, ``summary.json``.
- :mod:`~rootopt.train.run.failures`: what a failure leaves behind, and its one line.
- :mod:`~rootopt.train.run.signals`: stop signals while a run is set up and while it trains.
- :mod:`~rootopt.train.run.agree`: one verdict per failure across ranks.

Imports :mod:`rootopt.train.models`, :mod:`rootopt.train.metrics` and the components
built outside the loop (:mod:`rootopt.train.build`, ``schedule``, ``sync``); the
checkpointer and the loop import it.
"""
