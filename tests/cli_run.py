"""`python -m dpcuda ARGS` for the command-line tests, run one of two ways:

- in a new interpreter (process=True, or with env or code): what a user runs, imports and all;
- in this process (the default): dpcuda.cli.main(ARGS) as `python -m dpcuda` calls it, with the
  child's working directory, its own stdout and stderr, its exit status (argparse's SystemExit
  included), an uncaught exception's traceback on stderr with status 1, and a new interpreter's
  warning filters, printed to that stderr, as are an exception in a thread and one ignored in a
  destructor (pytest would turn those into warnings) and help text 80 columns wide. It saves a
  new interpreter's 2-3 s of imports a call (most of the command-line tests' time on a 2-core
  machine). torch's random states, the working directory and the warning filters are restored
  afterwards. A call past its timeout raises Expired in the test (SIGALRM), or, stuck where
  Python cannot raise, ends the test run 60 s later with every thread's traceback on the real
  stderr (faulthandler), where a hung child would be killed.

What only a new process can show (import-time output, signals, torchrun, environment
variables) stays in the tests that run one; a clean stderr of a whole run and of a refusal is
checked in a new interpreter too."""

import contextlib
import faulthandler
import importlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A new interpreter's warning filters (no -W, no PYTHONWARNINGS, a release build).
_FRESH_FILTERS = [("default", DeprecationWarning, "__main__"),
                  ("ignore", DeprecationWarning, ""), ("ignore", PendingDeprecationWarning, ""),
                  ("ignore", ImportWarning, ""), ("ignore", ResourceWarning, "")]


# The real stderr, for faulthandler's last word (tests/conftest.py sets it before pytest
# captures fd 2; None: sys.__stderr__).
REAL_STDERR = None


class Expired(BaseException):
    """An in-process call ran past its timeout (a BaseException, as KeyboardInterrupt: the
    command's own `except Exception` handlers do not turn it into an exit status)."""


class Completed:
    """What subprocess.run returns, plus seconds (the call's wall time)."""

    def __init__(self, args, returncode, stdout, stderr, seconds):
        self.args, self.returncode, self.stdout, self.stderr = args, returncode, stdout, stderr
        self.seconds = seconds


def run(*args, env=None, code=None, timeout=300, process=False, cwd=ROOT):
    """`python -m dpcuda *args` (or `python -c code *args`) from cwd; env: variables added to
    this process's. In this process unless process, env or code asks for a new one."""
    start = time.monotonic()
    if process or env is not None or code is not None:
        full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep +
                        os.environ.get("PYTHONPATH", ""))
        full_env.update(env or {})
        cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "dpcuda",
                                                                *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=full_env)
        return Completed(proc.args, proc.returncode, proc.stdout, proc.stderr,
                         time.monotonic() - start)
    from dpcuda import cli
    return _in_process([str(a) for a in args], timeout, cwd, start, cli.main, ["dpcuda"])


def run_script(name, *args, timeout=300, cwd=ROOT):
    """`python benchmarks/NAME.py *args` in this process (its main(args), sys.argv[0] the
    script's path), as run() runs the command line: for what a script refuses (its exit status
    and stderr). A script's run itself is tested in a new interpreter."""
    start = time.monotonic()
    folder = os.path.join(ROOT, "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    main = importlib.import_module(name).main
    path = os.path.join(folder, f"{name}.py")
    argv = sys.argv

    def script_main(args):
        sys.argv = [path, *args]  # (argparse's prog, as the script's)
        try:
            return main(args)
        finally:
            sys.argv = argv
    return _in_process([str(a) for a in args], timeout, cwd, start, script_main, [path])


def _in_process(args, timeout, cwd, start, main, command):
    out, err = io.StringIO(), io.StringIO()
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    here = os.getcwd()
    columns = os.environ.get("COLUMNS")
    hooks = threading.excepthook, sys.unraisablehook

    def expired(signum, frame):
        raise Expired(f"{' '.join(command + args)}: still running after {timeout} s")
    alarm = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    faulthandler.dump_traceback_later(timeout + 60, exit=True,
                                      file=REAL_STDERR or sys.__stderr__)
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_FRESH_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            # (pytest records warnings; a child prints them on its stderr)
            warnings.showwarning = lambda message, category, filename, lineno, file=None, \
                line=None: sys.stderr.write(warnings.formatwarning(message, category, filename,
                                                                   lineno, line))
            threading.excepthook, sys.unraisablehook = (threading.__excepthook__,
                                                        sys.__unraisablehook__)
            os.environ["COLUMNS"] = "80"  # (a child's stdout is a pipe: 80 columns)
            os.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    status = main(args)
                except SystemExit as stop:
                    status = stop.code
                except Exception:
                    traceback.print_exc()
                    status = 1
                if status is None:
                    status = 0
                elif not isinstance(status, int):  # sys.exit("message")
                    print(status, file=sys.stderr)
                    status = 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
        faulthandler.cancel_dump_traceback_later()
        threading.excepthook, sys.unraisablehook = hooks
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
        os.chdir(here)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return Completed([*command, *args], status, out.getvalue(), err.getvalue(),
                     time.monotonic() - start)
