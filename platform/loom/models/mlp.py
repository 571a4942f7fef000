"""A multilayer perceptron classifier (`model=mlp`), for feature-vector datasets (digits)."""

from __future__ import annotations

from torch import nn


class MLPClassifier(nn.Module):
    def __init__(self, in_features: int, hidden: list[int], num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.GELU(), nn.Dropout(dropout)]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)
