"""The training system's models behind one interface: ``model(batch) -> logits``.

- :mod:`~rootopt.train.models.builtin`: the built-in models (the byte Llama, the
  classifiers) and the loss (docs/models.md, "Two Llamas").
- :mod:`~rootopt.train.models.transformers_lm`: any ``transformers`` causal LM
  (``model.kind=hf``), its initial weights (``model.init_from``) and the conversion of the
  built-in Llama into ``LlamaForCausalLM`` that ``rootopt export`` writes.
- :mod:`~rootopt.train.models.factory`: the model a config asks for, with its vocabulary
  resolved from the data's tokenizer, and what a resume must match.

Nothing here imports the rest of the training system.
"""

from __future__ import annotations

from rootopt.train.models.builtin import (
    BYTE_VOCAB,
    DigitsCNN,
    LlamaLM,
    MLPClassifier,
    loss_fn,
)
from rootopt.train.models.factory import (
    blocks_of,
    build_model,
    data_vocab,
    resolve_vocab,
    resume_key,
    token_ids,
    with_vocab,
)

__all__ = [
    "BYTE_VOCAB",
    "DigitsCNN",
    "LlamaLM",
    "MLPClassifier",
    "blocks_of",
    "build_model",
    "data_vocab",
    "loss_fn",
    "resolve_vocab",
    "resume_key",
    "token_ids",
    "with_vocab",
]
