"""Non-blocking steps (DataParallel(..., blocking=False)): the update is queued with the
replicas' status records, which it reads on the device; the records reach host memory behind
an event and are read later, at a later step() or at synchronize().
"""

import dataclasses
import math
import warnings

import numpy as np
import torch


@dataclasses.dataclass
class PendingStep:
    """A non-blocking step not read yet: its status records (host memory, one per replica),
    the events after which they hold the devices' values, and what naming a bad label needs."""
    step: int
    records: list
    events: list
    targets: torch.Tensor
    summed: object
    classes: object


@dataclasses.dataclass
class PendingWindow:
    """The graphed steps of one copy of the device ring (graphed.py), not read yet: the ring's
    host copy, the rows of its steps in order, their (step, targets, summed, classes), and the
    events after which the copy holds the device's values. Read as a whole where no step of it
    skipped or saw a bad label (one check for the window, the common case); else as one
    PendingStep per step."""
    host: torch.Tensor
    rows: list
    window: list
    events: list

    @property
    def step(self):  # (its first step's)
        return self.window[0][0]

    def clean(self):
        """Whether no step of the window was skipped or saw a bad label (records' flags 0)."""
        flags = self.host.numpy()[:, :, 1:3]
        if len(self.rows) != len(flags):  # (a window cut short: its rows only)
            flags = flags[self.rows]
        return np.count_nonzero(flags) == 0

    def steps(self):
        return [PendingStep(step, list(self.host[row].unbind()), self.events, targets, summed,
                            classes)
                for row, (step, targets, summed, classes) in zip(self.rows, self.window)]


class PendingSteps:
    """The non-blocking part of DataParallel's step (a mixin: it reads the wrapper's replicas
    and its pending deque)."""

    def _step_async(self, records, targets, summed, global_den, count_on_device):
        """The rest of a non-blocking step: the update, which the records skip (and, with the
        labels counted on the device, rescale) there, and which writes the loss (the records'
        losses summed in replica order from 0.0, as the blocking step sums its reads) into a
        device tensor; the records copied to host memory, to be read later."""
        unused = set.intersection(*(r.unused for r in self._replicas))
        opt = self._optimizer
        if opt is not None and not self._fused_update.ready(opt, self._replicas, unused,
                                                            self._set.generation):
            # (checked before anything is queued: the weights stay as they were)
            raise ValueError(
                "dpcuda DataParallel: blocking=False with an optimizer needs the update fused "
                "into the reduction, which this step cannot take: it needs a dpcuda.optim "
                "optimizer over exactly dp.parameters() with no step pre-hooks, the same kind "
                "of state (and the same step count) in every parameter group, and a gradient "
                "for every parameter (a replica's forward left one unused); use blocking=True")
        kept = self._keep(unused) if unused and opt is None else None
        ring = self._graph_ring
        if ring is not None:
            # A graphed step's capture (graphed.py): the loss and the records into the static
            # loss and the device ring; the host's part of the step is done at each replay.
            if opt is not None:
                # (the records into the ring by the update's own bookkeeping launch)
                ring.norm = self._fused_update.device_update(
                    opt, self.algorithm, records, float(global_den), ring.loss, ring=ring.ring)
            else:
                self._reduce_p2p(records, float(global_den), ring.loss)
                if kept is not None:
                    for dst, src in kept:
                        dst.copy_(src)
                ring.write(records)
            return ring.loss
        # Everything that can fail is made before the update is queued (a step that raises
        # leaves the weights): the loss, the records' host memory (pinned, behind an event,
        # from CUDA devices), the events.
        loss = torch.empty((), dtype=torch.float64, device=self._replicas[0].device)
        cuda = sorted({r.device for r in self._replicas if r.device.type == "cuda"},
                      key=str)
        host = [torch.empty(x.numel(), dtype=torch.float64, pin_memory=bool(cuda))
                for x in records]
        events = [torch.cuda.Event() for _ in cuda]
        scaled_by = float(global_den) if count_on_device else 0.0
        issued = False
        try:
            if opt is not None:
                self._fused_update.update(opt, self._replicas, self.algorithm, records,
                                          scaled_by, loss)
            else:
                self._reduce_p2p(records, scaled_by, loss)
            issued = True
        finally:
            # An optimizer's post-hook that raises does so after the update was queued: the
            # step still counts and its records are still read (its skip, its bad label).
            if issued or (opt is not None and self._fused_update.issued):
                if kept is not None:
                    for dst, src in kept:
                        dst.copy_(src)
                self._consumed()
                if global_den == 0:
                    loss.fill_(math.nan)  # a mean over no labels, as torch's
                for h, x in zip(host, records):
                    h.copy_(x, non_blocking=bool(cuda))
                for event, device in zip(events, cuda):
                    event.record(torch.cuda.current_stream(device))
                self._pending.append(PendingStep(self.steps, host, events, targets, summed,
                                                 self._classes))
                self.steps += 1
        return loss

    def synchronize(self):
        """Waits for every step so far and reads what they found (blocking=False): warns for
        each skipped step, raises for a bad label. Call it before relying on skipped_steps."""
        self._settle(wait=True)

    def _settle(self, wait):
        """Reads the records of earlier non-blocking steps, oldest first: those the devices
        have finished, then, waiting for them, every one (wait) or those more than `lag` steps
        back. NaN/Inf gradients warn and count; a bad label (that step's update was skipped on
        the device) raises once every record this call reads is read, the first one's."""
        if wait and self._graphed is not None:
            self._graphed.flush(self)  # (the graphed steps' ring, read now)
        error, more = None, []
        while self._pending:
            pending = self._pending[0]
            step = pending.step
            if not all(e.query() for e in pending.events):
                # (the host may run `lag` copies of records ahead: a step's, or a ring's)
                if not wait and len({id(p.events) for p in self._pending}) < self.lag:
                    break
                for e in pending.events:
                    e.synchronize()
            self._pending.popleft()
            if isinstance(pending, PendingWindow):
                if not pending.clean():  # (its steps read one by one, next)
                    self._pending.extendleft(reversed(pending.steps()))
                continue
            rows = [h.numpy() for h in pending.records]  # host memory, read with no op
            if any(r[2] != 0 for r in rows):
                if error is None:
                    self._classes = pending.classes
                    try:
                        self._raise_label_error(pending.targets, pending.summed, step)
                    except ValueError as err:
                        error = err
                else:
                    more.append(step)
            elif any(r[1] != 0 for r in rows):
                self.skipped_steps += 1  # (before the warning, which a filter may raise)
                warnings.warn(f"dpcuda DataParallel: step {step} has NaN or Inf gradients; "
                              f"skipped (weights unchanged)", RuntimeWarning, stacklevel=3)
        if error is not None:
            if more:
                also = ", ".join(map(str, more))
                raise ValueError(f"{error}; step{'s' if len(more) > 1 else ''} {also} also had "
                                 f"a bad label (not applied either)")
            raise error
