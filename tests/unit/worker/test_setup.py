"""The digest of a model's parameters, and what the worker reports about tied weights."""

from __future__ import annotations

import torch
from torch import nn

from worker.start.parts import params_digest, shared_parameters


class Tied(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        if tie:
            self.head.weight = self.emb.weight


class EmbOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)


def test_a_tied_tensor_counts_once_in_the_digest() -> None:
    torch.manual_seed(0)
    tied = Tied(tie=True)
    only = EmbOnly()
    only.emb.weight.data.copy_(tied.emb.weight.data)
    assert params_digest(tied) == params_digest(only)
    untied = Tied(tie=False)
    untied.emb.weight.data.copy_(tied.emb.weight.data)
    untied.head.weight.data.copy_(tied.emb.weight.data)
    assert params_digest(untied) != params_digest(tied)  # two tensors with equal bytes are two


def test_shared_parameters_lists_the_names_of_one_tensor() -> None:
    assert shared_parameters(Tied(tie=True)) == [["emb.weight", "head.weight"]]
    assert shared_parameters(Tied(tie=False)) == []
