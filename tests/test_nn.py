import pytest
import torch
from torch import nn

from dpcuda.nn import FusedLinear, FusedMLP, SoftmaxCrossEntropyLoss, fuse
from conftest import DEVICES


def test_fused_linear_is_a_drop_in_for_linear():
    torch.manual_seed(3)
    linear = nn.Linear(13, 7)
    torch.manual_seed(3)
    fused = FusedLinear(13, 7, activation="none")
    # Same initialisation from the same seed, same state_dict keys and shapes.
    assert fused.state_dict().keys() == linear.state_dict().keys()
    for k in linear.state_dict():
        assert torch.equal(fused.state_dict()[k], linear.state_dict()[k])
    relu = FusedLinear(13, 7, activation="relu")
    relu.load_state_dict(linear.state_dict())
    x = torch.randn(4, 13)
    torch.testing.assert_close(relu(x), torch.relu(linear(x)))
    no_bias = FusedLinear(13, 7, bias=False)
    assert no_bias.bias is None and "bias" not in no_bias.state_dict()
    assert "activation='relu'" in repr(relu)


def test_fused_mlp_matches_sequential():
    mlp = FusedMLP([784, 256, 10])
    seq = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    seq.load_state_dict({k.replace("layers.", "").replace("1.", "2.", 1) if k.startswith(
        "layers.1") else k.replace("layers.", ""): v for k, v in mlp.state_dict().items()})
    x = torch.randn(16, 784)
    torch.testing.assert_close(mlp(x), seq(x))
    assert [layer.activation for layer in mlp.layers] == ["relu", "none"]


def test_fuse_replaces_linear_activation_pairs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 16),
                          nn.SiLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    want = model(x)
    keys = list(model.state_dict().keys())
    first_weight = model[0].weight
    fused = fuse(model)
    assert isinstance(fused[0], FusedLinear) and fused[0].activation == "gelu_tanh"
    assert isinstance(fused[1], nn.Identity)
    assert isinstance(fused[2], FusedLinear) and fused[2].activation == "silu"
    assert isinstance(fused[4], nn.Linear)
    assert fused[0].weight is first_weight
    assert list(fused.state_dict().keys()) == keys
    torch.testing.assert_close(fused(x), want)


def test_fuse_nested_and_bare_linear():
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    outer = nn.ModuleDict({"block": inner})
    fuse(outer)
    assert isinstance(outer["block"][0], FusedLinear)
    assert isinstance(fuse(nn.Linear(3, 2)), FusedLinear)


@pytest.mark.parametrize("device", DEVICES)
def test_loss_module_matches_cross_entropy_loss(device):
    z = torch.randn(9, 4, device=device, requires_grad=True)
    y = torch.randint(0, 4, (9,), device=device)
    ours = SoftmaxCrossEntropyLoss(label_smoothing=0.1)(z, y)
    want = nn.CrossEntropyLoss(label_smoothing=0.1)(z, y)
    torch.testing.assert_close(ours, want)


def test_bad_module_arguments():
    with pytest.raises(ValueError, match="activation must be one of"):
        FusedLinear(3, 2, activation="mish")
    with pytest.raises(ValueError, match="in_features must be"):
        FusedLinear(-1, 2)
    with pytest.raises(ValueError, match="sizes must list"):
        FusedMLP([10])
    with pytest.raises(ValueError, match="reduction must be one of"):
        SoftmaxCrossEntropyLoss(reduction="avg")
