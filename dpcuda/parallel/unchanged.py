"""The ops of dpcuda._C._unchanged (csrc/torch/unchanged.cpp): a tuple of (op, object, name,
expected) checks, each saying that an object still holds what it held, checked in one C call.
The replayed step's guard (replay_guard.py) and the fused update's view of the optimizer's
state (fused_update.py) are made of them."""

ATTR_IS, ABSENT, EMPTY, ITEMS, SAME, TYPE_IS, ITEM_IS, KEYS, TENSOR_IS, MODULE_ABSENT = range(10)


def items_of(d):
    """The ITEMS check of a dict as it is now (its keys and values, each the same object)."""
    return ITEMS, d, None, tuple(d.items())
