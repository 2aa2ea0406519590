"""dpcuda.cuda_available()'s test of a device against the build's architecture list, which
runs without a GPU: machine code serves its major version from its minor one up, PTX serves
every newer device."""

import pytest

from dpcuda import _archs_cover

BUILD = "7.5+PTX;8.0;9.0+PTX"


@pytest.mark.parametrize("capability,covered", [
    ((7, 5), True), ((8, 0), True), ((8, 6), True), ((8, 9), True), ((9, 0), True),
    ((10, 0), True), ((12, 0), True),  # from the PTX
    ((7, 0), False), ((6, 1), False), ((5, 2), False),
])
def test_default_build(capability, covered):
    assert _archs_cover(BUILD, capability) is covered


def test_machine_code_only():
    assert _archs_cover("8.0", (8, 6))
    assert not _archs_cover("8.6", (8, 0))
    assert not _archs_cover("9.0", (8, 0))
    assert not _archs_cover("8.0", (9, 0))  # no PTX: a newer major version has no code
    assert _archs_cover("8.0 9.0", (9, 0))  # spaces separate too


def test_unreadable_list_is_taken_to_cover():
    assert _archs_cover("", (3, 0))
    assert _archs_cover("sm_80", (8, 0))
