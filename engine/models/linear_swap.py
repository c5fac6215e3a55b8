"""Swapping a model's plain nn.Linear layers for a subclass that computes them another way
(row_invariant_linear.py, small_batch_linear.py), keeping the same parameter objects."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

Swapped = TypeVar("Swapped", bound=nn.Linear)


def swap_linears(
    model: nn.Module, cls: type[Swapped], accept: Callable[[nn.Linear], bool] = lambda linear: True
) -> list[Swapped]:
    """Replace every plain nn.Linear of `model` that `accept` takes by a `cls` holding the same weight
    and bias (tied weights stay tied; quantized and already swapped layers are not plain nn.Linear);
    returns the new layers. They are built on the meta device: their own storage is never allocated."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and accept(child)
    ]
    swapped = []
    for parent, name, linear in swaps:
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.weight = linear.weight
        layer.bias = linear.bias
        setattr(parent, name, layer)
        swapped.append(layer)
    return swapped
