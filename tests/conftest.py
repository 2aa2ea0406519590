import pytest
import torch

import dpcuda

DEVICES = ["cpu"] + (["cuda"] if dpcuda.cuda_available() else [])


def dtypes_for(device):
    """The dtypes the ops take on a device (the CPU computes the half types in float)."""
    return [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def assert_within_torch_error(ours, plain, reference, atol):
    """Our error against a float64 reference is at most twice the plain PyTorch path's error
    against the same reference, plus atol (the flash-attention rule)."""
    ours64, plain64 = ours.double(), plain.double()
    our_err = (ours64 - reference).abs().max().item() if reference.numel() else 0.0
    plain_err = (plain64 - reference).abs().max().item() if reference.numel() else 0.0
    if plain_err != plain_err or plain_err == float("inf"):
        plain_err = 0.0  # torch itself overflowed in this dtype: ours must be within atol
    assert our_err <= 2 * plain_err + atol, f"error {our_err} vs plain torch {plain_err}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
