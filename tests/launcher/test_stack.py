"""``kvstore up``'s supervision (launcher/supervisor.py) with real child processes: a child that
exits is restarted after a back-off that doubles, at most ``max_restarts`` times, then the
stack gives up with the child's log; a child that cannot be restarted stops the stack."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.supervisor import BACKOFF_S, Stack

ROOT = Path(__file__).resolve().parents[2]


def test_a_crashing_child_is_restarted_with_back_off_then_given_up(tmp_path, capsys):
    stack = Stack(log_dir=str(tmp_path / "logs"), max_restarts=2)
    stack.start("flaky", "--version")              # prints the version and exits 0 at once
    now, delays = 0.0, []
    try:
        with pytest.raises(RuntimeError, match="flaky exited .*2 restarts within 300 s already"):
            for _ in range(10):
                stack.children["flaky"].proc.wait(30)
                stack.supervise(now)                # sees the exit: schedules a restart
                child = stack.children["flaky"]
                delays.append(child.restart_at - now)
                stack.supervise(now + delays[-1] - 0.01)
                assert child.restart_at is not None  # not before its back-off
                now += delays[-1]
                stack.supervise(now)                # restarts it
                assert child.restart_at is None
    finally:
        stack.stop()
    assert delays == [BACKOFF_S[0], 2 * BACKOFF_S[0]]
    assert stack.restarts == 2
    out = capsys.readouterr().out
    assert out.count("restarted (pid") == 2 and "restart 2 of 2 in 1.0 s" in out
    assert (tmp_path / "logs" / "flaky.log").read_text().count("kvstore ") == 3   # appended


def test_the_children_log_at_the_stacks_level(tmp_path):
    """kvstore up's --log-level reaches each service it starts (their DEBUG lines: the router's
    decisions); a level the CLI does not know is its error in the child's log."""
    for level, expected in (("DEBUG", "kvstore "), ("LOUD", "invalid choice: 'LOUD'")):
        stack = Stack(log_dir=str(tmp_path / level), log_level=level)
        stack.start("child", "--version")
        try:
            stack.children["child"].proc.wait(30)
        finally:
            stack.stop()
        assert expected in (tmp_path / level / "child.log").read_text()


def test_a_child_that_cannot_be_restarted_stops_the_stack(tmp_path):
    stack = Stack(log_dir=str(tmp_path / "logs"))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    stack.adopt("redis", proc)
    proc.wait(30)
    with pytest.raises(RuntimeError, match="redis exited .*cannot be restarted"):
        stack.supervise()
    stack.stop()


def test_an_adopted_child_with_a_respawn_is_restarted_through_it(tmp_path, capsys):
    """A process started elsewhere (a vLLM server) is restarted by its own respawn callable,
    with the same back-off, and the stack stops the new process."""
    started: list[subprocess.Popen] = []

    def respawn() -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    stack = Stack(log_dir=str(tmp_path / "logs"))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "vllm-prefill-0.log").write_text("starting\nvllm.v1.engine.exceptions.EngineDeadError: "
                                                           "EngineCore encountered an issue\nshutting down\n")
    first = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    stack.adopt("vllm-prefill-0", first, respawn=respawn)
    first.wait(30)
    try:
        stack.supervise(0.0)
        assert stack.children["vllm-prefill-0"].restart_at == BACKOFF_S[0] and not started
        stack.supervise(BACKOFF_S[0])
        assert len(started) == 1 and stack.children["vllm-prefill-0"].proc is started[0]
        assert started[0].poll() is None
        stack.supervise(BACKOFF_S[0] + 1)            # alive: nothing more
        assert len(started) == 1
    finally:
        stack.stop()
    assert started[0].returncode is not None         # the restarted process was stopped too
    out = capsys.readouterr().out
    assert "vllm-prefill-0 exited unasked (exit status 3); restart 1 of 5" in out
    assert "vllm-prefill-0's last error: vllm.v1.engine.exceptions.EngineDeadError: EngineCore" in out
    assert f"vllm-prefill-0 restarted (pid {started[0].pid})" in out


def test_kvstore_up_wipes_only_a_data_dir_it_made(tmp_path) -> None:
    """--data-dir is wiped at start: an empty or new directory, or one kvstore up made, is
    (re)made 0700; a directory holding anything else is refused with the reason, untouched."""
    from launcher.up import STACK_MARK, fresh_data_dir

    mine = tmp_path / "up"
    assert fresh_data_dir(str(mine), keep=False) is None
    assert (mine / STACK_MARK).exists() and (mine.stat().st_mode & 0o777) == 0o700
    (mine / "old.log").write_text("x")
    assert fresh_data_dir(str(mine), keep=False) is None and not (mine / "old.log").exists()
    theirs = tmp_path / "home"
    theirs.mkdir()
    (theirs / "important.txt").write_text("keep me")
    problem = fresh_data_dir(str(theirs), keep=False)
    assert problem and "not made by kvstore up" in problem and "--keep-data" in problem
    assert (theirs / "important.txt").read_text() == "keep me"
    assert fresh_data_dir(str(theirs), keep=True) is None and (theirs / "important.txt").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    problem = fresh_data_dir(str(a_file), keep=False)      # was a raw "[Errno 17] File exists"
    assert problem and "cannot be used as a directory" in problem and a_file.read_text() == "not a directory"


def test_kvstore_up_refuses_a_data_dir_of_another_user_and_leaves_it_as_it_is(tmp_path) -> None:
    """A --data-dir another user made (root could chmod it 0700, and it would still be theirs,
    its tokens, logs and blocks readable by them) is refused before anything in it changes."""
    import pwd

    from launcher.up import fresh_data_dir
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user's")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chmod(theirs, 0o777)
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    problem = fresh_data_dir(str(theirs), keep=False)
    assert problem and "belongs to another user" in problem and "a directory of your own" in problem
    assert (theirs.stat().st_mode & 0o777) == 0o777 and list(theirs.iterdir()) == []


def test_kvstore_up_never_wipes_a_running_stack_or_an_unmarked_directory(tmp_path) -> None:
    """A directory holding logs/ and store/ but no mark is someone's (never taken for an old
    kvstore up's and wiped); a directory a running kvstore up holds is refused whole (a second
    kvstore up never wipes the first one's tokens and blocks); a link to a directory is that
    directory."""
    import subprocess
    import sys
    from pathlib import Path

    from launcher.up import STACK_MARK, fresh_data_dir

    theirs = tmp_path / "project"
    (theirs / "logs").mkdir(parents=True)
    (theirs / "store").mkdir()
    (theirs / "important.txt").write_text("keep me")
    problem = fresh_data_dir(str(theirs), keep=False)
    assert problem and "not made by kvstore up" in problem and (theirs / "important.txt").exists()

    running = tmp_path / "up"
    root = Path(__file__).resolve().parents[2]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from launcher.up import fresh_data_dir; "
         f"assert fresh_data_dir({str(running)!r}, keep=False) is None; print('held', flush=True); time.sleep(60)"],
        cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (running / "auth.env").write_text("the running stack's tokens")
        for keep in (False, True):
            problem = fresh_data_dir(str(running), keep=keep)
            assert problem and "in use by another kvstore up that is still running" in problem
        assert (running / "auth.env").read_text() == "the running stack's tokens"
    finally:
        holder.kill()
        holder.wait()
    assert fresh_data_dir(str(running), keep=False) is None and not (running / "auth.env").exists()

    target = tmp_path / "big-disk"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    assert fresh_data_dir(str(link), keep=False) is None and (target / STACK_MARK).exists()
    (target / "old.log").write_text("x")
    assert fresh_data_dir(str(link), keep=False) is None and not (target / "old.log").exists()
    assert link.is_symlink() and (target / STACK_MARK).exists()


def test_kvstore_up_refuses_a_bad_tier_size_before_starting_anything(tmp_path) -> None:
    """``kvstore up --dram nan`` started the private Redis before the store node refused the
    size; the sizes are checked first now, exit 2 naming the flag, nothing started. So are
    the replay's flags and its --start in the trace."""
    import os
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    for flags, said in ((["--dram", "nan"], "--dram: cannot read 'nan' as a size"),
                        (["--dram", "0"], "--dram: a tier of 0 bytes"),
                        (["--ssd", "9999999999TiB"], "--ssd: a tier of"),
                        # the replay's flags: these were refused only after the stack had started
                        (["--replay", str(root / "data" / "traces" / "conversation_trace.jsonl"), "--start",
                          "999999"], "--start 999999 is outside the trace (requests 0 to 12030)"),
                        (["--speed", "0"], "--speed: must be > 0 and finite, got 0"),
                        (["--window-s", "-1"], "--window-s: must be > 0 seconds"),
                        (["--max-output-tokens", "0"], "--max-output-tokens"),
                        # over vLLM: the checkpoint and the instances' cache size, before the store starts
                        (["--model", str(tmp_path / "nothing")], "not a checkpoint directory (no config.json"),
                        (["--vllm-kv-cache", "-5"], "--vllm-kv-cache"),
                        (["--vllm-max-model-len", "0"], "--vllm-max-model-len")):
        proc = subprocess.run([sys.executable, "-m", "launcher", "up", "--port", "0", "--data-dir",
                               str(tmp_path / "up"), *flags], cwd=root, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(root)})
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert "redis" not in proc.stdout.lower() and not (tmp_path / "up").exists(), proc.stdout


def _listener_with_a_connection_in_time_wait():
    """A listener (SO_REUSEADDR, no SO_REUSEPORT) on a free port of 127.0.0.1 whose one
    connection it closed first, so that its end waits in TIME-WAIT."""
    import socket
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    conn, _ = server.accept()
    conn.close()
    client.close()
    return server


def test_a_port_left_in_time_wait_is_free_and_a_listened_one_is_not() -> None:
    """A stack that just stopped leaves its front door's port in TIME-WAIT: kvstore up takes
    it (the services bind with SO_REUSEADDR too), and refuses a port something listens on."""
    from launcher.supervisor import port_is_free
    server = _listener_with_a_connection_in_time_wait()
    port = server.getsockname()[1]
    assert not port_is_free("127.0.0.1", port)       # still listening
    server.close()
    assert port_is_free("127.0.0.1", port)


def test_the_log_tail_leaves_out_the_resource_tracker_notes_of_a_killed_child(tmp_path):
    """A killed node's resource tracker reports the slab it unlinks as "leaked" (its cleanup,
    once per kill); those lines filled the tail shown when ``kvstore up`` gives up."""
    import os
    import signal
    import time
    stack = Stack(log_dir=str(tmp_path / "logs"))
    os.makedirs(stack.log_dir)
    code = ("from multiprocessing import shared_memory; import time; "
            "s = shared_memory.SharedMemory(create=True, size=4096); print('node serving', flush=True); time.sleep(60)")
    with open(os.path.join(stack.log_dir, "store.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
    log_path = os.path.join(stack.log_dir, "store.log")
    deadline = time.monotonic() + 30
    while "node serving" not in open(log_path).read():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    while "resource_tracker" not in open(log_path).read():   # the tracker notices and cleans up
        assert time.monotonic() < deadline, open(log_path).read()
        time.sleep(0.05)
    tail = stack.log_tail("store")
    assert "node serving" in tail and "resource_tracker" not in tail and "warnings.warn" not in tail, tail


def test_service_ports_are_taken_in_order_and_a_busy_one_is_named(tmp_path):
    import socket

    from launcher.supervisor import free_port, port_taker
    first, holds = free_port(), []
    take = port_taker("127.0.0.1", holds, first)
    assert take() == first
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", first + 1))
        except OSError:
            pytest.skip(f"port {first + 1} is in use already")
        busy.listen()
        with pytest.raises(RuntimeError, match=rf"--service-ports {first}: port {first + 1} on 127.0.0.1 is not free"):
            take()
    assert port_taker("127.0.0.1", holds)() > 0         # 0: a free port the system picks
    for sock in holds:
        sock.close()


def test_a_port_another_stack_of_this_user_holds_or_listens_on_is_not_free(tmp_path):
    """A hold (SO_REUSEPORT) may bind beside a listener of the same user that has SO_REUSEPORT
    too, and the kernel would then share its connections between the two stacks: a port
    something is bound to is refused before it is held."""
    import socket

    from launcher.supervisor import port_taker
    first_stack: list = []
    port = port_taker("127.0.0.1", first_stack)()
    with pytest.raises(RuntimeError, match=rf"--service-ports {port}: port {port} on 127.0.0.1 is not free"):
        port_taker("127.0.0.1", [], port)()
    first_stack[0].close()
    with socket.socket() as listener:           # a service of the first stack, beside its hold
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with pytest.raises(RuntimeError, match="is not free"):
            port_taker("127.0.0.1", [], port)()


def test_every_port_of_the_layout_is_held_and_the_private_redis_takes_none(monkeypatch, tmp_path):
    """Every service port kvstore up lays out is held by the stack until it stops; the private
    Redis (wanted unless ``--redis`` is given) listens on a Unix socket, so it takes no port
    (redis-server binds without SO_REUSEPORT: a port of its own could not be held)."""
    import argparse
    import shutil

    import launcher.up as up
    from launcher.supervisor import free_port
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    args = argparse.Namespace(host="127.0.0.1", prefill_instances=1, decode_instances=1, store_nodes=1, redis=None)
    stack = Stack(log_dir=str(tmp_path / "logs"))
    http_port = free_port()
    lay = up._layout(args, http_port, stack)
    taken = [*lay.store_ports, *(p for _, _, p in lay.engines), *lay.metrics_ports.values()]
    assert lay.private_redis and len(set(taken + [http_port])) == len(taken) + 1 == 7
    assert sorted(s.getsockname()[1] for s in stack.holds) == sorted(taken + [http_port])
    stack.stop()
    assert stack.holds == []
    other = Stack(log_dir=str(tmp_path / "logs2"))
    assert not up._layout(argparse.Namespace(**{**vars(args), "redis": "redis://x"}), free_port(), other).private_redis
    other.stop()


def test_the_private_redis_is_in_this_users_socket_directory_and_answers_only_its_password(tmp_path):
    """kvstore up's private Redis listens in this user's 0700 socket directory (never in a
    --data-dir another user could own or rename), under a password of any characters (quoted
    in its config, percent-encoded in its URL); it has started only once it answers PING
    under that password, so a listener already on the path is never taken for it."""
    import socket
    import stat

    import redis

    from kvstore.cluster.redis_server import socket_path, start_private_redis, stop_private_redis
    path = socket_path()
    st = os.stat(os.path.dirname(path))
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid() and len(path) < 100
    odd = tmp_path / 'a "b" c%20?#'
    odd.mkdir()
    stale = socket.socket(socket.AF_UNIX)        # a listener left on the path (not a Redis)
    stale.bind(str(odd / "redis.sock"))
    stale.listen()
    proc, url = start_private_redis(password='p w"%@', unix_socket=str(odd / "redis.sock"))
    try:
        client = redis.Redis.from_url(url)
        assert client.ping() and proc.poll() is None and (odd / "redis.sock").is_socket()
        with pytest.raises(redis.AuthenticationError):      # the password is needed
            redis.Redis(unix_socket_path=str(odd / "redis.sock")).ping()
        client.close()
    finally:
        stop_private_redis(proc)
        stale.close()


def test_the_private_redis_dies_with_kvstore_up_even_by_sigkill(tmp_path):
    """Started with the supervisor's death signal, the private Redis stops when kvstore up is
    killed -9 (it held the stack's Redis password, serving on, one more per kill)."""
    import signal
    import time

    import psutil
    code = ("import time; from kvstore.cluster.redis_server import start_private_redis, socket_path; "
            "proc, _ = start_private_redis(password='pw', unix_socket=socket_path(), die_with_parent=True); "
            "print(proc.pid, flush=True); time.sleep(60)")
    up = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        redis_pid = int(up.stdout.readline())
        assert psutil.pid_exists(redis_pid)
        up.send_signal(signal.SIGKILL)
        up.wait(10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(redis_pid) and psutil.Process(redis_pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "redis-server outlived its parent"
            time.sleep(0.1)
    finally:
        if up.poll() is None:
            up.kill()


def test_kvstore_up_says_when_its_front_door_takes_no_api_keys(tmp_path, capsys):
    import argparse

    from launcher.up import write_api_keys
    assert write_api_keys(argparse.Namespace(data_dir=str(tmp_path), api_key=None, api_keys_file=None)) is None
    assert "api keys       none: the front door serves every caller that reaches it" in capsys.readouterr().out
    path = write_api_keys(argparse.Namespace(data_dir=str(tmp_path), api_key=["sk-a"], api_keys_file=None))
    assert path and open(path).read() == "sk-a\n" and "api keys" not in capsys.readouterr().out


def test_sigterm_to_kvstore_up_over_vllm_unwinds_once_to_the_stop_of_every_service(capsys):
    """The vLLM instances run in sessions of their own: a SIGTERM that ended ``kvstore up``
    outright (its default action, during a start or a replay) left them running, 1.3 GB and a
    core each. It now unwinds to the ``finally`` that stops them, and a second signal during
    that stop does not cut it short."""
    import os
    import signal
    import time

    from launcher.up_vllm import _stopping_on_signal
    before = signal.getsignal(signal.SIGTERM)
    stopped = []

    def run() -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)            # the handler raises in here
            return 0
        finally:
            os.kill(os.getpid(), signal.SIGTERM)    # ignored: the stop runs to its end
            time.sleep(0.1)
            stopped.append(True)

    assert _stopping_on_signal(run) == 130 and stopped == [True]
    assert "kvstore up: SIGTERM: stopped" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before
