"""Higher-order gradients and torch.func transforms through the fused ops (#11 items 1 and 8).

A graph created through a fused op (create_graph=True) must have torch's second derivatives;
forward-mode AD and torch.func (grad, jvp, vjp, vmap, hessian) must give what the unfused torch
model gives. torch's own ops are the oracle, in float64, on random inputs.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, hessian, jvp, vjp, vmap

from dpcuda import ops, reference as ref
from dpcuda.nn import FusedMLP, fuse

ACTS = ["none", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"]
TORCH_ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU("tanh"),
              "silu": nn.SiLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}
REDUCTIONS = ["mean", "sum", "none"]


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [True, False])
def test_full_forward_gradgradcheck(activation, bias):
    x, w = _leaf(2, 3, 4), _leaf(5, 4)
    inputs = (x, w, _leaf(5)) if bias else (x, w)

    def f(x, w, b=None):
        return ops.full_forward(x, w, b, activation)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("strided_labels", [False, True])
def test_softmax_cross_entropy_gradgradcheck(reduction, label_smoothing, strided_labels):
    logits = _leaf(6, 5)
    # Strided labels take the kernel path that divides by a count tensor, contiguous ones the
    # path that folds a host count into the kernel's scale.
    labels = torch.tensor([0, 4, -100, 2, 2, 1, 3, 0, 1, 1, 0, 2])
    labels = labels[::2] if strided_labels else labels[:6]

    def f(z):
        return ops.softmax_cross_entropy(z, labels, reduction, label_smoothing)

    assert torch.autograd.gradcheck(f, (logits,))
    assert torch.autograd.gradgradcheck(f, (logits,))


def test_loss_grad_gradgradcheck():
    labels = torch.tensor([3, -100, 0, 1])
    assert torch.autograd.gradgradcheck(
        lambda z: ops.loss_grad(z, labels, 0.25, 0.1)[0], (_leaf(4, 5),))


@pytest.mark.parametrize("activation", sorted(TORCH_ACTS))
@pytest.mark.parametrize("seed", range(3))
def test_gradient_penalty_matches_torch(activation, seed):
    """The issue's repro: a gradient penalty through a fused model, parameters' gradients."""
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(6, 5), TORCH_ACTS[activation](), nn.Linear(5, 3)).double()
    fused = fuse(copy.deepcopy(plain))
    assert any(isinstance(m, type(fused[0])) for m in fused)  # really fused
    x = torch.randn(8, 6, dtype=torch.float64)
    labels = torch.randint(0, 3, (8,))
    grads = []
    for model, loss_fn in ((plain, F.cross_entropy), (fused, ops.softmax_cross_entropy)):
        xi = x.clone().requires_grad_()
        out = model(xi)
        loss = loss_fn(out, labels)
        (gx,) = torch.autograd.grad(loss, xi, create_graph=True)
        (loss + gx.pow(2).sum()).backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_hessian_vector_product_of_the_loss():
    logits = torch.randn(7, 4, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 3, -100, 1, 0])
    v = torch.randn_like(logits)
    hvps = []
    for loss_fn in (F.cross_entropy, ops.softmax_cross_entropy):
        z = logits.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss_fn(z, labels, label_smoothing=0.2), z,
                                   create_graph=True)
        (hvp,) = torch.autograd.grad((g * v).sum(), z)
        hvps.append(hvp)
    torch.testing.assert_close(hvps[1], hvps[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("activation", ACTS)
def test_torch_func_on_full_forward(activation):
    x, w, b = (torch.randn(4, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64),
               torch.randn(5, dtype=torch.float64))

    def fused(x, w, b):
        return ops.full_forward(x, w, b, activation)

    def plain(x, w, b):
        return ref.full_forward(x, w, b, activation)

    tangents = tuple(torch.randn_like(t) for t in (x, w, b))
    # grad and hessian in every argument
    for argnums in (0, 1, 2):
        torch.testing.assert_close(grad(lambda *a: fused(*a).sum(), argnums)(x, w, b),
                                   grad(lambda *a: plain(*a).sum(), argnums)(x, w, b))
    torch.testing.assert_close(hessian(lambda w: fused(x, w, b).sum())(w),
                               hessian(lambda w: plain(x, w, b).sum())(w))
    # jvp and vjp
    torch.testing.assert_close(jvp(fused, (x, w, b), tangents), jvp(plain, (x, w, b), tangents))
    out_f, vjp_f = vjp(fused, x, w, b)
    out_p, vjp_p = vjp(plain, x, w, b)
    cot = torch.randn_like(out_p)
    torch.testing.assert_close(out_f, out_p)
    torch.testing.assert_close(vjp_f(cot), vjp_p(cot))
    # vmap over a batch of weights, and per-sample gradients
    ws = torch.randn(3, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(vmap(lambda w: fused(x, w, b))(ws),
                               vmap(lambda w: plain(x, w, b))(ws))
    per_sample = vmap(grad(lambda w, xi: fused(xi[None], w, b).sum()), in_dims=(None, 0))
    per_sample_ref = vmap(grad(lambda w, xi: plain(xi[None], w, b).sum()), in_dims=(None, 0))
    torch.testing.assert_close(per_sample(w, x), per_sample_ref(w, x))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_torch_func_on_losses(reduction):
    logits = torch.randn(6, 5, dtype=torch.float64)
    labels = torch.tensor([0, 4, -100, 2, 2, 1])

    def fused(z):
        return ops.softmax_cross_entropy(z, labels, reduction, 0.1).sum()

    def plain(z):
        return F.cross_entropy(z, labels, reduction=reduction, label_smoothing=0.1).sum()

    torch.testing.assert_close(grad(fused)(logits), grad(plain)(logits))
    torch.testing.assert_close(hessian(fused)(logits), hessian(plain)(logits))
    t = torch.randn_like(logits)
    torch.testing.assert_close(jvp(fused, (logits,), (t,)), jvp(plain, (logits,), (t,)))
    # loss_grad: the loss's gradient under grad() equals the gradient the op returns
    scaled = grad(lambda z: ops.loss_grad(z, labels, 0.5, 0.1)[0])(logits)
    torch.testing.assert_close(scaled, ops.loss_grad(logits, labels, 0.5, 0.1)[1])
    # An out-of-range label still raises inside a transform.
    with pytest.raises((IndexError, ValueError, RuntimeError)):
        grad(lambda z: ops.softmax_cross_entropy(z, torch.tensor([0, 9, 1, 1, 1, 1])))(logits)


def test_torch_func_on_fused_mlp_parameters():
    model = FusedMLP([6, 8, 3], activation="gelu").double()
    plain = model.to_sequential()
    params = {k: v.detach() for k, v in model.named_parameters()}
    plain_params = {k: v.detach() for k, v in plain.named_parameters()}
    x = torch.randn(5, 6, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1])

    def loss(p, m, names):
        return F.cross_entropy(functional_call(m, p, (x,)), labels)

    got = grad(loss)(params, model, None)
    want = grad(loss)(plain_params, plain, None)
    for (k, g), (k2, g2) in zip(got.items(), want.items()):
        torch.testing.assert_close(g, g2)


@pytest.mark.parametrize("activation", ACTS)
def test_forward_mode_ad(activation):
    x, w, b = (torch.randn(4, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64),
               torch.randn(5, dtype=torch.float64))
    labels = torch.tensor([0, 1, 4, -100])
    with fwAD.dual_level():
        dual = fwAD.make_dual(w, torch.randn_like(w))
        out = ops.full_forward(x, dual, b, activation)
        want = ref.full_forward(x, dual, b, activation)
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent,
                                   fwAD.unpack_dual(want).tangent)
        got_loss = ops.softmax_cross_entropy(out, labels)
        want_loss = F.cross_entropy(want, labels)
        torch.testing.assert_close(fwAD.unpack_dual(got_loss).tangent,
                                   fwAD.unpack_dual(want_loss).tangent)


def test_first_order_backward_keeps_the_fused_kernels():
    """Without create_graph the backward is the fused one (one node per layer, no ATen
    recomputation): the graph holds the C++ node, and its gradient equals the kernels'."""
    x, w, b = _leaf(4, 6), _leaf(5, 6), _leaf(5)
    out = ops.full_forward(x, w, b, "tanh")
    assert out.grad_fn.name() == "FullForwardBackward"
    go = torch.randn_like(out)
    out.backward(go)
    gi, gw, gb = ops.full_backward(go, x.detach(), w.detach(), out.detach(), "tanh")
    assert torch.equal(x.grad, gi) and torch.equal(w.grad, gw) and torch.equal(b.grad, gb)


def test_in_place_changes_after_the_forward():
    """A first-order backward does not read the bias or the logits (as torch's linear and
    log_softmax do not), so changing them in place after the forward is allowed; a
    create_graph backward, which reads them, says they changed."""
    x, w, b = _leaf(4, 3), _leaf(2, 3), _leaf(2)
    y = ops.full_forward(x, w, b, "relu")
    with torch.no_grad():
        b.add_(1.0)
    y.sum().backward()
    for fn in (lambda z, t: ops.softmax_cross_entropy(z, t),
               lambda z, t: ops.loss_grad(z, t, 0.5)[0]):
        z = _leaf(4, 3) * 2
        labels = torch.tensor([0, 1, 2, 1])
        loss = fn(z, labels)
        z.add_(1.0)
        loss.backward()
        leaf = _leaf(4, 3)
        z = leaf * 2
        loss = fn(z, labels)
        z.add_(1.0)
        with pytest.raises(RuntimeError, match="its logits, has been modified by an inplace"):
            torch.autograd.grad(loss, leaf, create_graph=True)
    y = ops.full_forward(x, w, b, "tanh")
    with torch.no_grad():
        b.add_(1.0)
    with pytest.raises(RuntimeError, match="its bias, has been modified by an inplace"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.parametrize("act", ["relu", "gelu", "none"])
def test_the_node_keeps_torchs_autograd_contract(act):
    """full_forward's node (a Node with saved variables, as torch's generated ones) behaves as
    torch's linear + activation: a second backward without retain_graph refuses, with it the
    gradients accumulate; an input, weight or saved output changed in place refuses; the
    saved-tensor hooks see what it saves and hand it back; the edges reach the leaves."""
    # (fixed inputs: with random ones about 1 run in 27 had every relu output at or below zero,
    # zero gradients on both sides, and the hooks' check below failed with nothing wrong)
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, dtype=torch.float64, generator=gen).requires_grad_()
               for s in ((4, 3), (2, 3), (2,)))
    y = ops.full_forward(x, w, b, act)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()
    g1 = x.grad.clone()
    y = ops.full_forward(x, w, b, act)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert torch.equal(x.grad, 3 * g1)
    nexts = [f[0].variable for f in ops.full_forward(x, w, b, act).grad_fn.next_functions]
    assert nexts[0] is x and nexts[1] is w and nexts[2] is b
    for victim in ("x", "w") + (("y",) if act == "relu" else ()):
        xi, wi = _leaf(4, 3) * 1, _leaf(2, 3) * 1
        y = ops.full_forward(xi, wi, b, act)
        with torch.no_grad():
            {"x": xi, "w": wi, "y": y}[victim].add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.clone()
    hx, hw = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t * 2):
        y = ops.full_forward(hx, hw, b, act)
    rx, rw = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = ops.full_forward(rx, rw, b.detach(), act)
    # what the backward reads went through the hooks: the unpacked weight is doubled
    y.sum().backward()
    ref.sum().backward()
    assert len(packed) == {"relu": 3, "gelu": 3, "none": 2}[act], packed
    assert rx.grad.abs().sum() > 0
    if act == "none":
        assert torch.allclose(hx.grad, 2 * rx.grad)
    else:
        assert not torch.allclose(hx.grad, rx.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape,layout", [((33, 20), "dense"), ((3, 11, 20), "dense"),
                                          ((33, 20), "transposed"), ((33, 20), "expanded")])
def test_the_node_hands_its_saved_tensor_to_the_cpu_backward_unless_the_graph_is_kept(
        dtype, act, bias, shape, layout):
    """Where the graph is not kept, the CPU backward drops the node's references to what it
    saved after its activation pass, before the GEMMs: a pre-activation (gelu, gelu_tanh, silu)
    is freed there, as torch's activation node frees its input; a layer's output (relu, sigmoid,
    tanh) stays with whoever holds it. The gradients are the op's bits in every case; a kept
    graph, a create_graph backward and a second call over `saved` (the DataParallel
    destinations onto an existing .grad) keep it."""
    from dpcuda import _C

    def released():
        return _C._saved_released_for_tests()

    def delta(before):
        after = released()
        return after[0] - before[0], after[1] - before[1]

    kind = ops.saved_for_backward(act)
    hands = (0, 0) if kind is None else (1, 1) if kind == "pre" else (1, 0)
    gen = torch.Generator().manual_seed(7)
    x0 = torch.randn(shape, generator=gen).to(dtype)
    w0 = (torch.randn(24, 20, generator=gen) * 0.3).to(dtype)
    b0 = torch.randn(24, generator=gen).to(dtype) if bias else None
    go = torch.randn(shape[:-1] + (24,), generator=gen).to(dtype)
    if layout == "transposed":
        go = go.t().contiguous().t()
    elif layout == "expanded":
        go = go[:1].expand_as(go)
    out, pre = torch.ops.dpcuda.full_forward(x0, w0, b0, act)
    want = ops.full_backward(go, x0, w0, out if kind == "output" else pre if kind else None,
                             act, (True, True, bias))
    del out, pre

    def leaves():
        return [t.clone().requires_grad_() if t is not None else None for t in (x0, w0, b0)]

    def check(x, w, b, times=1):
        for got, w_ in zip((x.grad, w.grad, b.grad if bias else None), want):
            if got is not None:
                assert torch.equal(got, times * w_), (got, w_)

    x, w, b = leaves()
    n = released()
    ops.full_forward(x, w, b, act).backward(go)
    assert delta(n) == hands
    check(x, w, b)
    # a kept graph: nothing handed over until the backward that does not keep it
    x, w, b = leaves()
    y = ops.full_forward(x, w, b, act)
    n = released()
    y.backward(go, retain_graph=True)
    assert delta(n) == (0, 0)
    y.backward(go)
    assert delta(n) == hands
    check(x, w, b, times=2)
    del y
    # under saved-tensor hooks what the hook unpacks is handed over (here the packed tensor
    # itself, which the hooks' storage holds until then: freed with the node's saved variable)
    x, w, b = leaves()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        y = ops.full_forward(x, w, b, act)
    n = released()
    y.backward(go)
    assert delta(n)[0] == hands[0]
    check(x, w, b)
    del y
    # create_graph: torch's ops, nothing handed over
    x, w, b = leaves()
    n = released()
    torch.autograd.grad(ops.full_forward(x, w, b, act), x, go, create_graph=True)
    assert delta(n) == (0, 0)
    # DataParallel's destinations: handed over; onto an existing .grad of the weight or of the
    # bias (a second call reads `saved` again) not
    x, w, b = leaves()
    gw = torch.empty_like(w)
    gb = torch.empty_like(b) if bias else None
    n = released()
    ops.full_forward(x, w, b, act, _grads_into=(gw, gb)).backward(go)
    assert delta(n) == hands
    check(x, w, b)
    for existing in ("weight", "bias") if bias else ("weight",):
        x.grad = None
        w.grad = torch.zeros_like(w) if existing == "weight" else None
        if bias:
            b.grad = torch.zeros_like(b) if existing == "bias" else None
        n = released()
        ops.full_forward(x, w, b, act, _grads_into=(gw, gb)).backward(go)
        assert delta(n) == (0, 0)
        check(x, w, b)
