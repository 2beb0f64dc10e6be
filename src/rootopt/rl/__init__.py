"""A learned controller for ROOT (optional extra ``rootopt[rl]``).

The training run is a :mod:`gymnasium` environment (:mod:`rootopt.rl.env`): every ``K``
optimizer steps the policy sees cheap statistics (loss trend, gradient norm, ROOT telemetry)
and sets a multiplier of the scheduled lr and ROOT's outlier quantile; the reward is the
decrease of the log training loss. The policy is ``sb3-contrib``'s ``RecurrentPPO`` (an LSTM
actor with a value head). :mod:`rootopt.rl.controller` loads a saved policy into a training
run (``optimization.controller: PATH``). See ``docs/outlook.md``.

Nothing here is imported by ``import rootopt``.
"""
