"""DataParallel's step streams (dpcuda/parallel/streams.py) on a model of CUDA's stream order,
which runs on the CPU: each stream a queue with a vector clock, wait_stream a join of clocks,
so that "a happens before b" is exact. Random programs of steps, side work and the callers' own
work, from several streams, checked for the order the step promises; the checker is seen to
fire on a twin that skips the waits. The real streams run in tests/test_cuda_step.py."""

import contextlib
import copy
import pickle
import random

import pytest
import torch

from dpcuda.parallel.streams import StepStreams

DEV = torch.device("cuda:0")


class _CaptureError(Exception):
    pass


class _Stream:
    def __init__(self, model, name):
        self.model, self.name = model, name
        self.clock = {}
        self.cap = None  # the capture this stream takes part in (CUDA's stream capture)

    def wait_stream(self, other):
        # CUDA's capture rules: a capturing stream may wait only on work of its own capture,
        # and a stream that waits on captured work joins that capture.
        if self.cap is not None and other.cap is not self.cap:
            raise _CaptureError(f"{self.name}, capturing, waits on {other.name}'s work")
        if self.cap is None and other.cap is not None:
            self.cap = other.cap
            other.cap.joined.add(self)
        if self.cap is not None and self is self.cap.origin:
            self.cap.rejoined.add(other)
        self.model.waits += 1
        for k, v in other.clock.items():
            self.clock[k] = max(self.clock.get(k, 0), v)

    @property
    def capturing(self):
        return self.cap is not None

    def op(self):
        """An operation queued on this stream: its timestamp."""
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        return self.name, dict(self.clock)

    def __repr__(self):
        return self.name


class _Cuda:
    """The stand-in of torch.cuda that StepStreams uses: current_stream, Stream, stream."""

    def __init__(self):
        self.waits = 0
        self.made = 0
        self.current = _Stream(self, "default")
        self.index = 0  # the current device

    def current_stream(self, device):
        return self.current

    def current_device(self):
        return self.index

    def is_current_stream_capturing(self):
        # (as torch: the current device's current stream; this model's streams are device 0's,
        # and device 1's current stream never captures)
        return self.index == 0 and getattr(self.current, "capturing", False)

    def device(self, index):
        return _setting(self, "index", index)

    def Stream(self, device):
        self.made += 1
        return _Stream(self, f"own{self.made}")

    def stream(self, s):
        return _setting(self, "current", s)


@contextlib.contextmanager
def _setting(obj, name, value):
    """obj.name = value for the block, as torch's device and stream contexts set theirs."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


def before(a, b):
    """Whether operation a happens before operation b (vector clocks)."""
    (stream, clock), (_, later) = a, b
    return clock[stream] <= later.get(stream, 0)


class _NoWaits(StepStreams):
    """The broken twin: every step on the caller's stream, side work on our own with no wait."""

    def run(self, fn):
        return fn()

    def side(self, device):
        return self._own()[device]


def program(order, cuda, streams, seed, length=60, captures=0.0):
    """Random steps, side work and callers' work from the streams, and with captures > 0 that
    share of captures of one or two steps in between (on a new stream or a caller's, after
    the device's work, as torch.cuda.graph synchronises first); returns what went wrong: a
    step or side work out of order, or CUDA's capture rules broken."""
    rng = random.Random(seed)
    steps, sides, wrong = [], [], []
    for i in range(length):
        caller = rng.choice(streams)
        cuda.current = caller
        what = rng.random()
        if what < captures:
            origin = rng.choice([_Stream(cuda, f"capture{i}")] + streams[1:])
            for s in streams + list(order.own.values()):
                origin.wait_stream(s)
            capture = _Capture(origin)
            cuda.current = origin
            try:
                for _ in range(rng.choice([1, 2])):
                    order.run(lambda: cuda.current_stream(DEV).op())
                capture.end()
            except _CaptureError as err:
                return wrong + [f"capture at {i}: {err}"]
            continue
        mine = caller.op()  # the caller's work before (its batch)
        if what < captures + 0.7:
            done = order.run(lambda: cuda.current_stream(DEV).op())
            for earlier in steps + sides:
                if not before(earlier, done):
                    wrong.append(f"step {i} not after {earlier}")
            if not before(mine, done):
                wrong.append(f"step {i} not after its caller's work")
            after = caller.op()  # the caller reads the loss
            if not before(done, after):
                wrong.append(f"the caller's work after step {i} came before it")
            if order.home is not None and not before(done, order.home[1][DEV].op()):
                # (what a direct step allocated is reused by the home stream's work)
                wrong.append(f"the home stream's work after step {i} came before it")
            steps.append(done)
        else:
            s = order.side(DEV)
            with cuda.stream(s):
                done = s.op()
            for earlier in steps:
                if not before(earlier, done):
                    wrong.append(f"side work {i} not after {earlier}")
            sides.append(done)
    return wrong


def captures(order, cuda, streams, seed):
    """program with captures in between."""
    return program(order, cuda, streams, seed, length=80, captures=0.15)


def callers():
    """A model of torch.cuda and its callers' streams: the default one and two more."""
    cuda = _Cuda()
    return cuda, [cuda.current] + [_Stream(cuda, f"caller{i}") for i in range(2)]


def faults(check, cls, seeds):
    """What check (program or captures) finds wrong with StepStreams class cls, over seeds."""
    found = []
    for seed in seeds:
        cuda, streams = callers()
        found += check(cls([DEV, torch.device("cpu")], cuda=cuda), cuda, streams, seed)
    return found


def test_a_step_from_the_previous_steps_stream_makes_no_waits():
    # The common loop: every step from one stream runs on it, with no event or wait; only the
    # first step (and one after work of our own, or from another stream) takes our stream.
    cuda = _Cuda()
    order = StepStreams([DEV], cuda=cuda)
    ran_on = []
    for _ in range(10):
        order.run(lambda: ran_on.append(cuda.current_stream(DEV).name))
    assert cuda.waits == 2 and cuda.made == 1
    assert ran_on == ["own1"] + ["default"] * 9
    order.side(DEV)
    assert cuda.waits == 3
    order.run(lambda: ran_on.append(cuda.current_stream(DEV).name))
    order.run(lambda: ran_on.append(cuda.current_stream(DEV).name))
    assert ran_on[-2:] == ["own1", "default"] and cuda.waits == 5
    other = _Stream(cuda, "other")
    cuda.current = other
    order.run(lambda: ran_on.append(cuda.current_stream(DEV).name))
    # (our stream waits for "other" and for "default", where the previous step ran; then
    # "other" and the home stream, "default", wait for ours)
    assert ran_on[-1] == "own1" and cuda.waits == 9
    # Steps from a stream other than the home one always take our stream.
    order.run(lambda: ran_on.append(cuda.current_stream(DEV).name))
    assert ran_on[-1] == "own1" and cuda.waits == 12
    # Another current device: our streams (which make devices[0] current, as before).
    cuda.current = order.home[1][DEV]
    order.run(lambda: None)
    order.run(lambda: None)
    assert cuda.waits == 14
    cuda.index = 1
    order.run(lambda: None)
    assert cuda.waits == 16
    # The first step itself from another current device: the home is devices[0]'s, so later
    # steps with that device current still take our streams.
    cuda = _Cuda()
    cuda.index = 1
    order = StepStreams([DEV], cuda=cuda)
    for _ in range(3):
        order.run(lambda: None)
    assert cuda.waits == 6
    cuda.index = 0  # (then direct)
    order.run(lambda: None)
    order.run(lambda: None)
    assert cuda.waits == 6


def test_another_thread_is_not_the_home():
    # (a handle such as cudaStreamPerThread is another stream in another thread)
    import threading
    cuda = _Cuda()
    order = StepStreams([DEV], cuda=cuda)
    order.run(lambda: None)
    order.run(lambda: None)
    assert cuda.waits == 2
    t = threading.Thread(target=order.run, args=(lambda: None,))
    t.start()
    t.join()
    assert cuda.waits == 4


def test_side_work_orders_every_device_after_a_direct_step():
    # Two devices: a step directly on the home streams, side work on device 0, then a step
    # from other streams: after the direct step on both devices.
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")

    class Cuda2(_Cuda):
        def __init__(self):
            super().__init__()
            self.cur = {0: _Stream(self, "default0"), 1: _Stream(self, "default1")}

        def current_stream(self, device):
            return self.cur[device.index]

        def Stream(self, device):
            self.made += 1
            s = _Stream(self, f"own{device.index}_{self.made}")
            s.index = device.index
            return s

        @contextlib.contextmanager
        def stream(self, s):
            before_, self.cur[s.index] = self.cur[s.index], s
            try:
                yield
            finally:
                self.cur[s.index] = before_

    cuda = Cuda2()
    order = StepStreams([d0, d1], cuda=cuda)
    step = lambda: {d: cuda.current_stream(torch.device("cuda", d)).op() for d in (0, 1)}  # noqa
    order.run(step)
    direct = order.run(step)
    assert order.direct
    order.side(d0)
    cuda.cur = {0: _Stream(cuda, "c0"), 1: _Stream(cuda, "c1")}
    later = order.run(step)
    assert before(direct[0], later[0]) and before(direct[1], later[1])


def test_a_failing_step_still_has_the_caller_wait():
    cuda = _Cuda()
    order = StepStreams([DEV], cuda=cuda)
    caller = cuda.current

    def fails():
        cuda.current_stream(DEV).op()
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        order.run(fails)
    own = order.own[DEV]
    assert before((own.name, dict(own.clock)), caller.op())
    # The next step takes our stream again (the failed one set nothing up).
    order.run(lambda: None)
    assert cuda.waits == 4


def test_no_cuda_devices_run_the_step_as_it_is():
    order = StepStreams([torch.device("cpu")] * 2)
    assert order.run(lambda: 7) == 7
    assert order.side(torch.device("cpu")) is None


def test_a_copy_starts_without_streams():
    cuda = _Cuda()
    order = StepStreams([DEV], cuda=cuda)
    order.run(lambda: None)
    for clone in (copy.deepcopy(order), pickle.loads(pickle.dumps(order))):
        assert clone.own == {} and clone.last is None and clone.home is None
        assert clone.cuda is torch.cuda
        assert clone.devices == [DEV]


class _Capture:
    """A stream capture (torch.cuda.graph) on stream origin: at its end every stream that
    joined it (by waiting on its work) must have been joined back into origin (origin waited
    on it after its last work), as cudaStreamEndCapture requires."""

    def __init__(self, origin):
        self.origin, self.joined, self.rejoined = origin, set(), set()
        origin.cap = self

    def end(self):
        for s in self.joined:
            if s not in self.rejoined or \
                    s.clock.get(s.name, 0) > self.origin.clock.get(s.name, 0):
                raise _CaptureError(f"{s.name} is not joined back at the end of the capture")
        for s in list(self.joined) + [self.origin]:
            s.cap = None


class _CaptureBlind(StepStreams):
    """The broken twin: a step inside a capture is taken for an ordinary one."""

    def _capturing(self):
        return False


@pytest.mark.parametrize("check", [program, captures])
@pytest.mark.parametrize("seed", range(15))
def test_steps_keep_their_order_and_the_capture_rules(check, seed):
    # (program: steps, side work and callers' work from three streams; captures: the same
    # with captures of steps in between)
    assert faults(check, StepStreams, [seed]) == []


@pytest.mark.parametrize("check, twin", [(program, _NoWaits), (captures, _CaptureBlind)])
def test_the_checkers_fire_on_broken_twins(check, twin):
    assert faults(check, twin, range(10))


def test_a_step_inside_the_callers_capture_leaves_the_home_streams_alone():
    # Inside torch.cuda.graph (a capturing stream), a step forks our stream from the capture
    # and joins it back, and neither waits for nor makes wait the home stream, which is not
    # captured (CUDA refuses such a wait during a capture); the next step goes on as before.
    cuda = _Cuda()
    order = StepStreams([DEV], cuda=cuda)
    home = cuda.current
    order.run(lambda: None)
    order.run(lambda: None)
    assert order.direct and cuda.waits == 2
    capture = _Stream(cuda, "capture")
    _Capture(capture)
    waited = []
    original = _Stream.wait_stream

    def wait_stream(self, other):
        waited.append((self.name, other.name))
        original(self, other)
    _Stream.wait_stream = wait_stream
    try:
        cuda.current = capture
        order.run(lambda: None)
    finally:
        _Stream.wait_stream = original
    assert waited == [("own1", "capture"), ("capture", "own1")]
    cuda.current = home
    order.run(lambda: None)
    assert cuda.waits == 4  # (direct again: the captured step ran nothing)
    # The same with another device current: the capture is asked on devices[0].
    cuda.current, cuda.index = capture, 1
    waited.clear()
    _Stream.wait_stream = wait_stream
    try:
        order.run(lambda: None)
    finally:
        _Stream.wait_stream = original
    assert waited == [("own1", "capture"), ("capture", "own1")]
    assert order.last[1][DEV] is home


def test_the_key_with_torch_cuda_reads_each_devices_current_stream_and_the_device(
        monkeypatch):
    # (on the CPU machine torch's C++ side is stood in: what the key is made of)
    current = {0: (7, 0, 1), 1: (9, 1, 1)}
    device = [0]
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda i: current[i],
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: device[0], raising=False)
    order = StepStreams([torch.device("cuda:0"), torch.device("cuda:1")])
    assert order.cuda is torch.cuda
    key = order._key()
    assert key == order._key()
    current[1] = (11, 1, 1)
    assert order._key() != key
    current[1] = (9, 1, 1)
    device[0] = 1
    assert order._key() != key
