"""The fork server's life (``fastload.launching.fork_server``), in scripts run as
users run them: it starts at ``import fastload`` in the script's own process
only, serves every loader of the process, and ends with the process, SIGKILL
included, even while a child forked from it lives on.

The in-process side (a later loader reuses it, ``fastload.shutdown()`` ends
it) is in ``test_zygote.py``; its leases, with fakes, in ``test_lineage.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Dict, List, Optional

import pytest

from support.processes import pid_alive, wait_pids_gone

TESTS = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.heavy  # fresh interpreters importing torch


def _env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FASTLOAD_INSTALL", "FASTLOAD_SERVER_AT_IMPORT")}
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _server_pid_after_import(tmp_path, code: str = "", **env: str) -> List[Optional[int]]:
    """The server pids the script prints: after ``import fastload`` in the
    script, and whatever ``code`` prints."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""\
        import fastload
        from fastload.launching.fork_server import fork_server_pid
        print(fork_server_pid(True), flush=True)
        """) + textwrap.dedent(code))
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(**env),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [None if w == "None" else int(w) for w in p.stdout.split()]


def test_import_starts_the_server_in_the_user_s_own_process_only(tmp_path):
    started = _server_pid_after_import(tmp_path)
    assert started[0] is not None
    assert wait_pids_gone(started, timeout=10) == []  # stopped at the script's exit
    assert _server_pid_after_import(tmp_path, FASTLOAD_SERVER_AT_IMPORT="0") == [None]
    # The FASTLOAD_INSTALL hook imports fastload in every Python process of a
    # tree: the first loader starts the server there.
    assert _server_pid_after_import(tmp_path, FASTLOAD_INSTALL="1") == [None]
    # A process multiprocessing starts imports the script again (as
    # __mp_main__): a spawned child, as a spawn DataLoader's workers are.
    got = _server_pid_after_import(tmp_path, """\
        import multiprocessing

        def report():
            print(fork_server_pid(True), flush=True)

        if __name__ == "__main__":
            p = multiprocessing.get_context("spawn").Process(target=report)
            p.start()
            p.join()
        """)
    # (the child prints twice: the script's top level, run again, and report)
    assert got[0] is not None and got[1:] == [None, None]


def test_the_server_ends_when_the_process_is_killed_even_with_a_forked_child_alive(tmp_path):
    """One server for a loader and for a loader made after it is gone; the
    script SIGKILLed while a child it forked still runs (holding a copy of
    every fd the script had, but for the server's socket): the server ends."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import multiprocessing, time
        import fastload
        from fastload.launching.fork_server import fork_server_pid
        from support.datasets import Plain

        if __name__ == "__main__":
            at_import = fork_server_pid(True)
            loader = fastload.FastLoader(Plain(8), batch_size=2, num_workers=2)
            assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
            del loader
            later = fastload.FastLoader(Plain(4), batch_size=2, num_workers=2)
            assert [b.tolist() for b in later] == [[0, 1], [2, 3]]
            child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
            child.start()
            print(at_import, fork_server_pid(True), child.pid, flush=True)
            time.sleep(120)
        """))
    p = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.stderr else ""
        at_import, server, child = (int(w) for w in line.split())
        assert at_import == server and pid_alive(server)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert pid_alive(child)
        assert wait_pids_gone([server], timeout=10) == []
    finally:
        p.kill()
        p.wait()
        for stream in (p.stdout, p.stderr):
            if stream is not None:
                stream.close()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
