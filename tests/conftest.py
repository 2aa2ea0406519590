import copy

import pytest
import torch
import torch.nn.functional as F

import dpcuda


def pytest_configure(config):
    """The real stderr for tests/cli_run.py's last-resort timeout (before pytest captures it)."""
    import os

    import cli_run
    cli_run.REAL_STDERR = os.fdopen(os.dup(2), "w")


def pytest_unconfigure(config):
    import cli_run
    if cli_run.REAL_STDERR is not None:
        cli_run.REAL_STDERR.close()
        cli_run.REAL_STDERR = None


DEVICES = ["cpu"] + (["cuda"] if dpcuda.cuda_available() else [])


def dtypes_for(device):
    """The dtypes the ops take on a device (the CPU computes the half types in float)."""
    return [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def assert_within_torch_error(ours, plain, reference, atol):
    """Our error against a float64 reference is at most twice the plain PyTorch path's error
    against the same reference, plus atol (the flash-attention rule). Where torch itself
    overflowed in this dtype (plain non-finite, the reference finite), ours may give torch's
    value (dpcuda rounds where torch rounds) or be within atol of the reference."""
    ours64, plain64 = ours.double(), plain.double()
    if not reference.numel():
        return
    overflow = ~plain64.isfinite() & reference.isfinite()
    same = (ours64 == plain64) | (ours64.isnan() & plain64.isnan())
    near = (ours64 - reference).abs() <= atol
    assert bool((same | near)[overflow].all()), "differs where torch overflowed"
    keep = ~overflow
    our_err = (ours64 - reference)[keep].abs().max().item() if keep.any() else 0.0
    plain_err = (plain64 - reference)[keep].abs().max().item() if keep.any() else 0.0
    assert our_err <= 2 * plain_err + atol, f"error {our_err} vs plain torch {plain_err}"


def reference_train(model, data, lr, momentum, weight_decay):
    """A copy of model trained on one device by torch.optim.SGD: the oracle of the data-parallel
    tests."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                          weight_decay=weight_decay)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def make_model(fused, dtype=torch.float32):
    """The 12-16-5 relu MLP the DataParallel tests train: dpcuda's FusedMLP or torch's
    nn.Sequential, seeded alike."""
    torch.manual_seed(1)
    if fused:
        from dpcuda.nn import FusedMLP
        return FusedMLP([12, 16, 5]).to(dtype)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 5)).to(dtype)
