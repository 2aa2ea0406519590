"""The streams of DataParallel's steps on CUDA: each step ordered after the previous one and
after the work its caller queued, and the caller's streams after the step, whichever stream or
thread issued each step, with no stream or event work at all in the common case.

A step issued from its home streams (those of the first step, from the thread that issued it)
when the previous step was issued from them too runs on them directly: stream order alone puts
it after the previous step and after the caller's work, and puts what the caller queues next
after it. torch's Stream.wait_stream makes, records, waits on and frees an event (four driver
calls), so the two waits of a step taken on a stream of our own cost eight driver calls, where
a direct step costs none. Any other step runs on DataParallel's own stream of each device: that
stream waits for the caller's streams and, when the previous step ran directly, for the home
streams; then the caller's streams and the home streams wait for it. Work that DataParallel
queues outside a step on its own stream (side()) makes the next step take its own stream
again, so that it comes after that work too.

Why one home and not whichever stream the previous step came from: what a direct step
allocates (the static batch of a graph, a rebuilt replica) comes from the home streams' pools
of the caching allocator and may be freed at a later step; every step that does not run on the
home streams is followed by a wait of the home streams, so work on them, a reuse of such memory
among it, comes after every use. (The thread is part of the home: a stream handle such as
cudaStreamPerThread names another stream in another thread.)

`cuda` is torch.cuda, or a stand-in with the same current_stream, current_device, device,
is_current_stream_capturing, Stream and stream (a test's record of the waits on the CPU, where
there are no streams). With torch.cuda, whether a step is direct is asked of torch's C++ side
(the current streams' ids and the current device) without making Stream objects: on a GPU a
small step's time is the host's, and torch.cuda.current_stream costs about as much as the rest
of the check.
"""

import contextlib
import threading

import torch


class StepStreams:
    """Orders the steps of one DataParallel (the module docstring). run(fn) runs one step."""

    def __init__(self, devices, cuda=torch.cuda):
        self.devices = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
        self.cuda = cuda
        self.own = {}       # device -> DataParallel's stream there, made at first need
        self.home = None    # (thread, {device: stream}) of the first step
        self.last = None    # the previous step's (thread, {device: stream}), or None
        self.direct = False  # whether the previous step ran on the home streams themselves
        self.home_key = None  # (thread, the home streams' identities, devices[0]'s index)

    def __getstate__(self):  # (copy.deepcopy, pickle: streams are not state; a copy starts afresh)
        return {"devices": self.devices, "own": {}, "home": None, "last": None,
                "direct": False, "home_key": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.cuda = torch.cuda

    def _own(self):
        if not self.own:
            self.own = {d: self.cuda.Stream(d) for d in self.devices}
        return self.own

    def _key(self):
        """(thread, the current streams' identities, the current device): equal to home_key
        when a step may run directly (its streams the home's, with devices[0] current, as a
        step taken on our streams runs)."""
        if self.cuda is torch.cuda:
            get = torch._C._cuda_getCurrentStream  # ((stream id, device index, device type))
            return (threading.get_ident(), tuple(get(d.index) for d in self.devices),
                    torch._C._cuda_getDevice())
        return (threading.get_ident(), tuple(self.cuda.current_stream(d) for d in
                                             self.devices), self.cuda.current_device())

    def run(self, fn):
        """fn() as one step, ordered (the module docstring); returns its result."""
        if not self.devices:
            return fn()
        key = self._key()
        if self.last is not None and self.last is self.home and key == self.home_key:
            self.direct = True
            return fn()
        callers = (key[0], {d: self.cuda.current_stream(d) for d in self.devices})
        # A step inside the caller's own stream capture (torch.cuda.graph around dp.step) runs
        # nothing now: it forks our streams from the capture and joins them back, and touches
        # neither the home streams (a wait between captured and uncaptured work is an error of
        # the capture) nor what the next step does.
        capturing = self._capturing()
        if self.home is None and not capturing:
            self.home = callers
            self.home_key = key[:2] + (self.devices[0].index,)
        own = self._own()
        for d, s in own.items():
            if self.direct and not capturing and self.home[1][d] != callers[1][d]:
                s.wait_stream(self.home[1][d])  # (the previous step ran there)
            s.wait_stream(callers[1][d])
        # Once our streams wait for the caller's, nothing that follows may skip them: a step
        # that fails below still has the caller's streams wait for what it queued.
        if not capturing:
            self.last, self.direct = None, False
        try:
            with contextlib.ExitStack() as stack:
                for d in reversed(self.devices):  # (devices[0]'s last: the current device)
                    stack.enter_context(self.cuda.stream(own[d]))
                result = fn()
        finally:
            for d, s in own.items():
                callers[1][d].wait_stream(s)
                if not capturing and self.home[1][d] != callers[1][d]:
                    self.home[1][d].wait_stream(s)
        if not capturing:
            self.last = self.home if callers == self.home else callers
        if torch.is_tensor(result) and result.device.type == "cuda" and \
                result.device in callers[1]:
            # (made on our stream, freed by the caller's: the allocator waits for the caller)
            result.record_stream(callers[1][result.device])
        return result

    def _capturing(self):
        """Whether the caller's stream on devices[0] is capturing (torch asks the current
        device's, and the caller's current device may be another)."""
        with self.cuda.device(self.devices[0].index):
            return self.cuda.is_current_stream_capturing()

    def side(self, device):
        """DataParallel's own stream on device for work outside a step (reading the ring),
        after the steps and the caller's work; None on a device without streams. The next
        step takes our streams again, so that it comes after this work."""
        if device not in self.devices:
            return None
        own = self._own()
        current = self.cuda.current_stream(device)
        own[device].wait_stream(current)
        if self.direct:
            # (the previous step ran on the home streams: every device's own stream waits for
            # them, as the next step, on our streams, must come after it on every device)
            for d, s in own.items():
                if d != device or self.home[1][d] != current:
                    s.wait_stream(self.home[1][d])
        self.last, self.direct = None, False
        return own[device]
