import warnings

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


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"])
def test_fused_mlp_to_and_from_sequential(activation):
    mlp = FusedMLP([6, 5, 4, 3], activation=activation)
    seq = mlp.to_sequential()
    assert list(seq.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight",
                                      "4.bias"]
    x = torch.randn(7, 6)
    torch.testing.assert_close(seq(x), mlp(x))
    # A plain model of the same shape loads the fused model's weights, and back.
    plain = torch.nn.Sequential(*[type(m)() if not isinstance(m, torch.nn.Linear) else
                                  torch.nn.Linear(m.in_features, m.out_features) for m in seq])
    if activation == "gelu_tanh":
        plain[1] = torch.nn.GELU(approximate="tanh")
        plain[3] = torch.nn.GELU(approximate="tanh")
    plain.load_state_dict(seq.state_dict())
    torch.testing.assert_close(plain(x), mlp(x))
    back = FusedMLP.from_sequential(plain)
    assert back.layers[0].weight is plain[0].weight  # shared, not copied
    torch.testing.assert_close(back(x), plain(x))
    assert back.sizes == [6, 5, 4, 3]


def test_from_sequential_refuses_what_is_not_an_mlp():
    with pytest.raises(TypeError, match="sequential"):
        FusedMLP.from_sequential(torch.nn.Linear(3, 2))
    for bad in (torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()),
                torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(),
                                    torch.nn.Linear(2, 2)),
                torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2),
                                    torch.nn.Tanh(), torch.nn.Linear(2, 1))):
        with pytest.raises(ValueError, match="sequential"):
            FusedMLP.from_sequential(bad)
    with pytest.raises(ValueError, match="chain"):
        FusedMLP.from_sequential(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(),
                                                     torch.nn.Linear(3, 2)))


def test_fuse_names_a_bad_argument_and_keeps_hooked_layers():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        fuse(None)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2),
                              torch.nn.ReLU())
    seen = []
    seq[0].register_forward_hook(lambda m, i, o: seen.append(o))
    x = torch.randn(5, 4)
    want = seq(x)
    with pytest.warns(UserWarning, match="left unfused .*: 0: it has hooks of its own"):
        fuse(seq)
    assert isinstance(seq[0], torch.nn.Linear) and isinstance(seq[2], FusedLinear)
    seen.clear()
    torch.testing.assert_close(seq(x), want)
    assert len(seen) == 1  # the hook still fires, on the Linear's own output
    with pytest.warns(UserWarning, match="left unfused"):
        lone = torch.nn.Linear(2, 2)
        lone.register_forward_pre_hook(lambda m, i: None)
        assert fuse(lone) is lone


@pytest.mark.parametrize("bias", [True, False])
def test_flop_counter_counts_the_fused_layers_as_torchs(bias):
    # torch.utils.flop_counter.FlopCounterMode counts a FusedLinear as it counts nn.Linear: the
    # forward's GEMM, and the backward's two (one where the input needs no gradient).
    from torch.utils.flop_counter import FlopCounterMode
    from dpcuda.nn import FusedLinear
    fused = FusedLinear(64, 32, bias=bias, activation="gelu")
    plain = nn.Linear(64, 32, bias=bias)
    x = torch.randn(16, 3, 64)
    for needs_grad in [True, False]:
        counts = []
        for layer in (fused, plain):
            with FlopCounterMode(display=False) as counter:
                layer(x.clone().requires_grad_(needs_grad)).sum().backward()
            counts.append(counter.get_total_flops())
        assert counts[0] == counts[1] == 2 * 48 * 64 * 32 * (3 if needs_grad else 2)


def test_meta_tensors_among_real_ones_raise_and_meta_alone_runs():
    # A meta tensor among real ones sends the call to the fake kernel, which computes nothing:
    # without the check, uninitialised memory came back as the result (a module built on meta
    # for deferred initialisation and called before it was materialised, issue #27's review).
    from dpcuda import ops
    from dpcuda.nn import FusedLinear
    layer = FusedLinear(3, 5, activation="gelu", device="meta")
    x, w, go = torch.randn(4, 3), torch.randn(5, 3), torch.randn(4, 5)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        layer(x)
    with pytest.raises(ValueError, match="weight is on cpu but x is on meta"):
        ops.full_forward(x.to("meta"), w)
    with pytest.raises(ValueError, match="bias is on meta but x is on cpu"):
        ops.full_forward(x, w, torch.zeros(5, device="meta"))
    for args, name in [((go, x, w.to("meta")), "weight"), ((go, x.to("meta"), w), "x")]:
        with pytest.raises(ValueError, match=f"{name} is on meta but grad_output is on cpu"):
            ops.full_backward(*args, go, "gelu")
    with pytest.raises(ValueError, match="saved is on meta"):
        ops.full_backward(go, x, w, go.to("meta"), "gelu")
    with pytest.raises(ValueError, match="labels is on cpu but logits is on meta"):
        ops.softmax_cross_entropy(torch.randn(4, 5, device="meta"), torch.tensor([1, 2, 3, 4]))
    out = layer(x.to("meta"))
    assert out.device.type == "meta" and out.shape == (4, 5)
    # The tensors a kernel does not read (saved for "none", an output the mask leaves out) may
    # lie anywhere, as the real kernels allow (a CPU placeholder in a CUDA call, traced with fake
    # CUDA tensors); only a meta one among real ones is refused.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake_cuda(*shape):
        return FakeTensor(mode, torch.empty(*shape, device="meta"), torch.device("cuda:0"))

    fgo, fx, fw = fake_cuda(4, 5), fake_cuda(4, 3), fake_cuda(5, 3)
    with mode:
        outs = torch.ops.dpcuda.full_backward(fgo, fx, fw, torch.empty(0), "none", [True] * 3)
        assert [t.device.type for t in outs] == ["cuda"] * 3
        gi = torch.ops.dpcuda.full_backward_into(fgo, fx, fw, torch.empty(0), "none",
                                                 [True, False, False], torch.empty(0),
                                                 torch.empty(0))
        assert gi.device.type == "cuda"
        with pytest.raises(ValueError, match="saved is on cpu but grad_output is on cuda"):
            torch.ops.dpcuda.full_backward(fgo, fx, fw, torch.empty(4, 5), "gelu", [True] * 3)
        with pytest.raises(ValueError, match="grad_weight is on cpu but grad_output is on cuda"):
            torch.ops.dpcuda.full_backward_into(fgo, fx, fw, torch.empty(0), "none",
                                                [True, True, False], torch.empty(5, 3),
                                                torch.empty(0))
    with pytest.raises(ValueError, match="saved is on meta but grad_output is on cpu"):
        torch.ops.dpcuda.full_backward(go, x, w, torch.empty(0, device="meta"), "none",
                                       [True] * 3)


def test_in_place_collectives_trace_and_run_on_meta():
    import dpcuda.parallel as par
    meta = [torch.empty(5, device="meta") for _ in range(2)]
    torch.ops.dpcuda.all_reduce_(meta, "sum", "auto")
    torch.ops.dpcuda.reduce_sgd_(meta, [torch.empty(5, device="meta")] * 2, [], 0.1, 0.0, 0.0,
                                 True, "auto")
    hyper = [torch.empty(16, dtype=torch.float64, device="meta")]
    torch.ops.dpcuda.optim_update_(meta[:1], meta[1:], [], [], [], hyper[0], "sgd")
    torch.ops.dpcuda.reduce_update_(meta, [torch.empty(5, device="meta")] * 2, [], [], [],
                                    hyper * 2, [0, 5, 0], "sgd", False, "auto")
    with pytest.raises(ValueError, match="is on cpu but params"):
        torch.ops.dpcuda.optim_update_(meta[:1], [torch.empty(5)], [], [], [], hyper[0], "sgd")

    def f(a, b):
        par.all_reduce([a, b], op="mean")
        return a * 2

    a, b = torch.randn(6), torch.randn(6)
    want_a = a.clone()
    a2, b2 = a.clone(), b.clone()
    f(want_a, b.clone())
    got = torch.compile(f, fullgraph=True, backend="eager")(a2, b2)
    torch.testing.assert_close(got, want_a * 2)
    torch.testing.assert_close(a2, b2)


class _ScaledLinear(torch.nn.Linear):
    def forward(self, input):
        return super().forward(input) * 1.5


def test_fuse_leaves_what_is_not_exactly_torchs_linear_with_one_warning():
    # A Linear subclass with its own forward, QAT's fake-quantised Linear, a weight_norm
    # parametrisation and an activation subclass: each left as it is, all named in one warning,
    # and the model still computes what it did; the exact pair next to them is fused.
    from torch.nn.utils.parametrizations import weight_norm

    class MyTanh(torch.nn.Tanh):
        def forward(self, input):
            return super().forward(input) * 2

    torch.manual_seed(0)
    qat = torch.ao.nn.qat.Linear(4, 4, qconfig=torch.ao.quantization.get_default_qat_qconfig())
    seq = torch.nn.Sequential(_ScaledLinear(4, 4), torch.nn.ReLU(), qat, torch.nn.ReLU(),
                              weight_norm(torch.nn.Linear(4, 4)), torch.nn.GELU(),
                              torch.nn.Linear(4, 4), MyTanh(), torch.nn.Linear(4, 3),
                              torch.nn.Sigmoid())
    x = torch.randn(6, 4)
    want = seq(x)
    keys = sorted(seq.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fuse(seq)
    assert len(caught) == 1
    text = str(caught[0].message)
    for part in ("0: it is a", "_ScaledLinear", "2: it is a torch.ao.nn.qat", "4: it is "
                 "parametrized", "MyTanh, not torch's own activation"):
        assert part in text, (part, text)
    assert [type(m).__name__ for m in seq][:8] == [
        "_ScaledLinear", "ReLU", "Linear", "ReLU", "ParametrizedLinear", "GELU", "Linear",
        "MyTanh"]
    assert isinstance(seq[8], FusedLinear) and isinstance(seq[9], torch.nn.Identity)
    torch.testing.assert_close(seq(x), want)
    assert sorted(seq.state_dict()) == keys
