"""The streams of DataParallel's steps on CUDA: each step ordered after the previous one and
after the work its caller queued, and the caller's streams after the step, whichever stream or
thread issued each step, with no stream or event work at all in the common case.

A step issued from the streams the previous step was issued from runs on them directly: stream
order alone puts it after the previous step and after the caller's work, and puts what the
caller queues next after it. torch's Stream.wait_stream makes, records, waits on and frees an
event (four driver calls), so the two waits of a step taken on a stream of our own cost eight
driver calls, where a direct step costs none. A step from other streams (or the first) runs on
DataParallel's own stream of each device: that stream waits for the caller's streams and, when
the previous step ran directly on other streams, for those; the caller's streams then wait for
it. Work that DataParallel queues outside a step on its own stream (side()) makes the next step
take its own stream again, so that it comes after that work too.

`cuda` is torch.cuda, or a stand-in with the same current_stream, current_device, Stream and
stream (a test's record of the waits on the CPU, where there are no streams).
"""

import contextlib

import torch


class StepStreams:
    """Orders the steps of one DataParallel (the module docstring). run(fn) runs one step."""

    def __init__(self, devices, cuda=torch.cuda):
        self.devices = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
        self.cuda = cuda
        self.own = {}       # device -> DataParallel's stream there, made at first need
        self.last = None    # the previous step's caller streams ({device: stream}), or None
        self.direct = False  # whether the previous step ran on self.last itself

    def __getstate__(self):  # (copy.deepcopy, pickle: streams are not state; a copy starts afresh)
        return {"devices": self.devices, "cuda": None, "own": {}, "last": None,
                "direct": False}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.cuda = torch.cuda

    def _own(self):
        if not self.own:
            self.own = {d: self.cuda.Stream(d) for d in self.devices}
        return self.own

    def run(self, fn):
        """fn() as one step, ordered (the module docstring); returns its result."""
        if not self.devices:
            return fn()
        callers = {d: self.cuda.current_stream(d) for d in self.devices}
        # (with devices[0] current, as a step taken on our streams runs)
        if callers == self.last and self.cuda.current_device() == self.devices[0].index:
            self.direct = True
            return fn()
        own = self._own()
        for d, s in own.items():
            s.wait_stream(callers[d])
            if self.direct and self.last[d] != callers[d]:
                s.wait_stream(self.last[d])  # (the previous step ran there)
        # Once our streams wait for the caller's, nothing that follows may skip them: a step
        # that fails below still has the caller's streams wait for what it queued.
        self.last, self.direct = None, False
        try:
            with contextlib.ExitStack() as stack:
                for d in reversed(self.devices):  # (devices[0]'s last: the current device)
                    stack.enter_context(self.cuda.stream(own[d]))
                result = fn()
        finally:
            for d, s in own.items():
                callers[d].wait_stream(s)
        self.last = callers
        if torch.is_tensor(result) and result.device.type == "cuda" and \
                result.device in callers:
            # (made on our stream, freed by the caller's: the allocator waits for the caller)
            result.record_stream(callers[result.device])
        return result

    def side(self, device):
        """DataParallel's own stream on device for work outside a step (reading the ring),
        after the steps and the caller's work; None on a device without streams. The next
        step takes our streams again, so that it comes after this work."""
        if device not in self.devices:
            return None
        stream = self._own()[device]
        stream.wait_stream(self.cuda.current_stream(device))
        if self.direct and self.last[device] != self.cuda.current_stream(device):
            stream.wait_stream(self.last[device])
        self.last, self.direct = None, False
        return stream
