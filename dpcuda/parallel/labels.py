"""Bad labels in DataParallel's convenience step: dpcuda's CUDA loss kernel flags a label
outside [0, classes) on the device (read with the step's status records); the CPU kernels and
torch's losses raise at once. Either way the step raises a ValueError naming the first bad
position of the caller's batch, before any update.
"""

import torch

from .. import _C


class LabelError(ValueError):
    """A label outside [0, classes) that is not ignore_index, with its fields: position (in
    the labels the raising call was given), label, classes, ignore_index."""

    def __init__(self, message, position, label, classes, ignore_index):
        super().__init__(message)
        self.position, self.label = position, label
        self.classes, self.ignore_index = classes, ignore_index


def typed_label_error(err):
    """err as a LabelError if dpcuda's loss raised it on this thread for a bad label (the C++
    adapter records the fields: no parsing of the message), else None."""
    fields = _C._take_label_error()
    if fields is None or not isinstance(err, ValueError):
        return None
    return LabelError(str(err), *fields)


class LabelChecks:
    """The label checks of DataParallel's step (a mixin: it reads the wrapper's replicas)."""

    @staticmethod
    def _flag_tensor(device):
        """The bad-label flag of dpcuda's CUDA loss kernel on device (one int32), or None on
        the CPU, whose adapter raises at once."""
        return _C._label_error_flag(device.index) if device.type == "cuda" else None

    def _label_flag(self, device):
        """The flag as a float64 scalar tensor, to be read with the loss (0 on the CPU)."""
        flag = self._flag_tensor(device)
        return torch.zeros((), dtype=torch.float64) if flag is None else flag[0].double()

    def _raise_label_error(self, targets, summed, step=None):
        """A loss kernel saw a label outside [0, classes): raise naming the first bad position
        of the batch (before any update; the next step clears the flags as it starts). step:
        the earlier non-blocking step whose record said so."""
        classes = self._classes
        ignore = summed[1] if summed is not None else -100
        y = targets.detach().cpu().reshape(-1)
        bad = ((y != ignore) & ((y < 0) | (y >= classes))).nonzero() if classes else []
        if step is not None:
            if len(bad):
                i = int(bad[0])
                raise LabelError(f"step {step}: labels must be class indices in [0, {classes}) "
                                 f"or ignore_index ({ignore}); got {int(y[i])} at position {i} "
                                 f"(that step's update was not applied; nothing of this call "
                                 f"ran)", i, int(y[i]), classes, ignore)
            raise ValueError(f"step {step}: a label outside [0, classes) reached dpcuda's CUDA "
                             f"loss kernel (its targets no longer hold it); that step's update "
                             f"was not applied; nothing of this call ran")
        if len(bad):
            i = int(bad[0])
            where = " of this process's batch" if self.reducer == "dist" else ""
            raise LabelError(f"labels must be class indices in [0, {classes}) or ignore_index "
                             f"({ignore}); got {int(y[i])} at position {i}{where} (the step "
                             f"was not applied)", i, int(y[i]), classes, ignore)
        raise ValueError("a label outside [0, classes) reached dpcuda's CUDA loss kernel since "
                         "the last step (not in this step's targets); the step was not applied")

    def _shared_flag_devices(self):
        """The CUDA devices whose bad-label flag a step clears before it starts: those of more
        than one replica, and every one with reducer "dist" (which reads the flags itself)."""
        devices = [r.device for r in self._replicas if self._flag_tensor(r.device) is not None]
        return {d for d in devices if self.reducer == "dist" or devices.count(d) > 1}

    def _clear_label_flags(self):
        for device in {r.device for r in self._replicas}:
            flag = self._flag_tensor(device)
            if flag is not None:
                flag.zero_()

