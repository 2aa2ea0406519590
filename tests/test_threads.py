"""The CPU kernels run on torch's intra-op threads and give the same bits whatever their number."""

import pytest
import torch

import dpcuda
from dpcuda import _C
from dpcuda.ops import ACTIVATIONS


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def under_threads(fn):
    """fn() evaluated with 1, 2 and 3 intra-op threads."""
    results = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        results.append(fn())
    return results


def assert_all_bitwise_equal(results):
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first, other):
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch._C.has_openmp, reason="torch without OpenMP")
def test_parallel_for_uses_threads(restore_threads):
    # at::parallel_for compiles serial in an extension built without -fopenmp.
    torch.set_num_threads(2)
    assert _C._parallel_threads(64) == 2
    torch.set_num_threads(1)
    assert _C._parallel_threads(64) == 1


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_activation_passes_same_bits_for_any_thread_count(restore_threads, activation, dtype):
    grad_out = torch.randn(1000, 257, dtype=dtype)
    saved = torch.randn(1000, 257, dtype=dtype)
    x = torch.randn(1000, 3, dtype=dtype)
    w = torch.randn(257, 3, dtype=dtype)
    b = torch.randn(257, dtype=dtype)
    eye = torch.eye(257, dtype=dtype)

    def run():
        # The identity as the GEMM keeps MKL's thread-dependent blocking out of the comparison.
        out, pre = torch.ops.dpcuda.full_forward(saved, eye, b, activation)
        _, _, grad_bias = torch.ops.dpcuda.full_backward(grad_out, x, w, saved, activation,
                                                         [False, False, True])
        return out, pre, grad_bias

    assert_all_bitwise_equal(under_threads(run))


def test_loss_same_bits_for_any_thread_count(restore_threads):
    logits = torch.randn(3001, 37)
    labels = torch.randint(0, 37, (3001,))
    labels[::7] = -100

    def run():
        loss, grad = torch.ops.dpcuda.loss_grad(logits, labels, 1 / 3001, 0.1, -100, True)
        return loss, grad, dpcuda.ops.softmax_cross_entropy(logits, labels)

    assert_all_bitwise_equal(under_threads(run))


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "ring"])
def test_all_reduce_same_bits_for_any_thread_count(restore_threads, algorithm):
    base = [torch.randn(100003) for _ in range(3)]

    def run():
        tensors = [t.clone() for t in base]
        torch.ops.dpcuda.all_reduce_(tensors, "mean", algorithm)
        params = [t.clone() for t in base]
        grads = [t.flip(0).clone() for t in base]
        momentum = [torch.zeros_like(t) for t in base]
        torch.ops.dpcuda.reduce_sgd_(params, grads, momentum, 0.1, 0.9, 1e-4, True, algorithm)
        return tensors + params + momentum

    assert_all_bitwise_equal(under_threads(run))
