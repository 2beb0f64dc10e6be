"""Hugging Face ``transformers.Trainer`` integration: ROOT with rootopt's routing.

One line::

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ds,
        optimizer_cls_and_kwargs=rootopt.hf.optimizer_cls_and_kwargs(lr=3e-3),
    )

Why not ``optimizer_cls_and_kwargs=(rootopt.ROOT, {...})``: given a bare optimizer class,
the Trainer builds its own two groups (decay / no-decay) and ROOT splits them by tensor
rank, so the token and position embeddings and a tied output head are orthogonalized like
hidden matrices, which trains much worse (numbers in ``docs/integrations.md``). Here the
Trainer gets a *factory* (``transformers >= 5.5`` calls it with the model it trains), and
the factory builds the groups with :func:`rootopt.param_groups`: embeddings, tied or
untied heads, PEFT ``modules_to_save`` copies, LoRA factors, biases and norms on AdamW,
hidden matrices on ROOT, frozen parameters left out.

The Trainer's ``learning_rate`` and ``weight_decay`` are not used on this path (that is the
Trainer's rule for ``optimizer_cls_and_kwargs``); pass them here. Its LR scheduler,
gradient clipping, checkpointing and ``resume_from_checkpoint`` work unchanged.

This module does not import ``transformers``; ``import rootopt`` does not import it either.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rootopt.optim.root import ROOT
from rootopt.optim.routing import HEAD_NAMES, Rule, param_groups

logger = logging.getLogger(__name__)

# Keyword arguments that shape the routing (the rest are ROOT options).
_ROUTING_KEYS = frozenset(
    {"lora_lr_multiplier", "head_names", "rules", "include_frozen", "detect_heads"}
)


def create_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float | None = None,
    lora_lr_multiplier: float = 5.0,
    head_names: Sequence[str] = HEAD_NAMES,
    rules: Sequence[Rule] | None = None,
    include_frozen: bool = False,
    detect_heads: bool = True,
    **root_options: Any,
) -> ROOT:
    """:class:`ROOT` on :func:`rootopt.param_groups` of ``model``; logs the routing table.

    For ``Trainer(optimizers=(create_optimizer(model, lr=...), None))`` and for any other
    loop. ``root_options`` are ROOT's keyword arguments (``momentum``, ``ns_steps``...).
    """
    groups, report = param_groups(
        model,
        lr=lr,
        weight_decay=weight_decay,
        lora_lr_multiplier=lora_lr_multiplier,
        head_names=head_names,
        rules=rules,
        include_frozen=include_frozen,
        detect_heads=detect_heads,
        lr_scale=root_options.get("lr_scale", "moonlight"),
    )
    logger.info("ROOT routing for %s:\n%s", type(model).__name__, report)
    if weight_decay is not None:
        root_options["weight_decay"] = weight_decay
    return ROOT(groups, lr=lr, **root_options)


class ROOTFactory:
    """What the Trainer calls: ``ROOTFactory()(model, **kwargs)`` → :func:`create_optimizer`.

    ``transformers`` treats any first element of ``optimizer_cls_and_kwargs`` that is not a
    ``torch.optim.Optimizer`` subclass as such a factory (``>= 5.5``). Older versions
    would call it with their own parameter groups; that is refused with one line rather
    than silently training with the wrong routing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise TypeError(
                "rootopt.hf: this transformers version calls the optimizer with its own "
                "parameter groups (optimizer factories need transformers>=5.5); upgrade, or "
                "pass optimizers=(rootopt.hf.create_optimizer(model, lr=...), None)"
            )

    def __call__(self, model: nn.Module, **kwargs: Any) -> ROOT:
        return create_optimizer(model, **kwargs)


def optimizer_cls_and_kwargs(
    *, lr: float, weight_decay: float | None = None, **options: Any
) -> tuple[type[ROOTFactory], dict[str, Any]]:
    """The value for ``Trainer(optimizer_cls_and_kwargs=...)``: ROOT with rootopt's routing.

    ``options``: routing (``lora_lr_multiplier``, ``head_names``, ``rules``,
    ``include_frozen``, ``detect_heads``) and any ROOT keyword argument. They are checked
    now (one clear error), not at the first ``train()``."""
    root_opts = {k: v for k, v in options.items() if k not in _ROUTING_KEYS}
    if weight_decay is not None:
        root_opts["weight_decay"] = weight_decay
    ROOT([torch.zeros(2, 2)], lr=lr, **root_opts)  # validates every ROOT option
    return ROOTFactory, {"lr": lr, "weight_decay": weight_decay, **options}
