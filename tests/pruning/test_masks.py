import torch
from torch import nn

from hfl.pruning.masks import erk_counts, erk_densities, prunable_keys, random_masks


def two_layers():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_prunable_keys_are_conv_and_linear_weights_only():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    assert prunable_keys(model) == ["0.weight", "3.weight"]


def test_erk_split_by_hand():
    # raw densities (sum of dims / size): 8/16 = 0.5 and 6/8 = 0.75; at density 0.5 the 12 kept
    # entries spread as scale·raw·n with scale = 12 / (0.5·16 + 0.75·8) = 6/7: 6.86 and 5.14.
    shapes = {"a": torch.Size([4, 4]), "b": torch.Size([2, 4])}
    densities = erk_densities(shapes, 0.5)
    assert abs(densities["a"] - 3 / 7) < 1e-9 and abs(densities["b"] - 9 / 14) < 1e-9
    assert erk_counts(shapes, 0.5) == {"a": 7, "b": 5}


def test_erk_keeps_a_layer_dense_rather_than_above_one():
    # At density 0.9, b's share would be 1.16: b stays dense (8) and a takes the rest, 21.6 - 8.
    shapes = {"a": torch.Size([4, 4]), "b": torch.Size([2, 4])}
    densities = erk_densities(shapes, 0.9)
    assert densities["b"] == 1.0 and abs(densities["a"] - 13.6 / 16) < 1e-9


def test_random_masks_keep_the_erk_count_and_depend_on_the_generator():
    model = two_layers()
    masks = random_masks(model, 0.5, torch.Generator().manual_seed(0))
    assert set(masks) == {"0.weight", "2.weight"}
    assert masks["0.weight"].dtype == torch.bool and masks["0.weight"].shape == (4, 4)
    assert int(masks["0.weight"].sum()) == 7 and int(masks["2.weight"].sum()) == 5
    again = random_masks(model, 0.5, torch.Generator().manual_seed(0))
    other = random_masks(model, 0.5, torch.Generator().manual_seed(1))
    assert all(torch.equal(masks[k], again[k]) for k in masks)
    assert not all(torch.equal(masks[k], other[k]) for k in masks)
