"""What the local stack's servers share as child processes: how they are found, started and
asked whether they are up.

Terms:

* *go-installed binary*: a server built from source at a pinned version by
  ``scripts/setup.sh`` (``go install``); :func:`go_binary` finds it.
* *parent-death signal*: a signal the kernel sends a child when the process that started it
  dies, however it dies (``prctl(PR_SET_PDEATHSIG)``, Linux). The servers and the local
  stack's agents get SIGTERM this way, so none outlives a stack or test that was killed.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from shardvault.local.ports import free_port

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child receive SIGTERM when this process dies (None where
    there is no ``prctl``: there a killed parent leaves its children running).

    The kernel sends it when the *thread* that started the child ends, so start children
    from a thread that lives as long as they should (the local stack starts them from the
    caller's). The function is looked up here, in the parent: the child only calls it."""
    if _prctl is None:
        return None
    parent = os.getpid()
    prctl = _prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


def executable(path: str | os.PathLike[str] | None) -> Path | None:
    if path and Path(path).is_file() and os.access(path, os.X_OK):
        return Path(path)
    return None


def go_bin_dirs() -> list[Path]:
    """Where ``go install`` puts binaries: ``GOBIN`` if set, else the first GOPATH's ``bin``."""
    default = [Path.home() / "go" / "bin"]
    go = shutil.which("go")
    if go is None:
        return default
    try:
        out = subprocess.run(
            [go, "env", "GOBIN", "GOPATH"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return default
    gobin, gopath = [*out, "", ""][:2]
    dirs = [Path(gobin)] if gobin else []
    first_gopath = gopath.split(os.pathsep)[0]
    dirs.append(Path(first_gopath) / "bin" if first_gopath else default[0])
    return dirs


def go_binary(name: str, env_var: str) -> Path | None:
    """``$env_var``, else ``name`` on PATH, else the one ``go install`` built.

    An explicit ``$env_var`` is the only candidate when set: a wrong setting must not be
    papered over by some other binary."""
    explicit = os.environ.get(env_var)
    if explicit:
        return executable(explicit)
    on_path = executable(shutil.which(name))
    if on_path:
        return on_path
    for directory in go_bin_dirs():
        built = executable(directory / name)
        if built:
            return built
    return None


def why_missing(label: str, name: str, env_var: str) -> str:
    """Why :func:`go_binary` found no ``name``: a wrong ``$env_var``, or where it looked."""
    explicit = os.environ.get(env_var)
    if explicit:
        return f"{env_var}={explicit} is not an executable file."
    places = ", ".join(str(d / name) for d in go_bin_dirs())
    return f"{label} not found (looked on PATH and at {places})."


def log_tail(log_path: Path, offset: int, lines: int = 40) -> str:
    """The last ``lines`` a server logged since ``offset``: what a start error shows."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log empty)"


def probe_opener(https: bool) -> urllib.request.OpenerDirector:
    """An opener for asking a child server whether it is up."""
    # No proxies: CI machines often set HTTP(S)_PROXY, and loopback must not go through one.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if https:
        # The probe only asks our own child process whether it is up; certificate names are
        # the clients' business (they get the CA from certs_dir).
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


def wait_ready(process: subprocess.Popen, url: str, timeout: float) -> bool:
    """True once ``url`` answers 200; False if the process exited or the timeout passed."""
    opener = probe_opener(url.startswith("https:"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            with opener.open(url, timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:  # refused while starting, 503 until it is up, timeouts
            pass
        time.sleep(0.1)
    return False


def stop_child(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if the child has not exited within ``timeout`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


PORT_ATTEMPTS = 3  # an auto-picked port can be taken before the server binds it
_PORT_IN_USE = re.compile(r"address already in use|port .* in use", re.IGNORECASE)


class ServerStartError(RuntimeError):
    """A server exited or did not become ready; the message carries its log tail."""


def start_on_port(
    name: str,
    spawn: Callable[[int], subprocess.Popen],
    ready_url: Callable[[int], str],
    log_path: Path,
    port: int | None,
    timeout: float,
) -> tuple[subprocess.Popen, int]:
    """Starts a server (``spawn(port)``, its output appended to ``log_path``) and returns it
    and its port once ``ready_url(port)`` answers 200. ``port``: fixed, else a free one,
    retried when another process binds it first. A server that exits or is not ready in
    ``timeout`` seconds is stopped, and :class:`ServerStartError` carries its log tail."""
    attempts = 1 if port else PORT_ATTEMPTS
    for attempt in range(1, attempts + 1):
        chosen = port or free_port()
        offset = log_path.stat().st_size if log_path.exists() else 0
        started = time.monotonic()
        process = spawn(chosen)
        if wait_ready(process, ready_url(chosen), timeout):
            return process, chosen
        exited = process.poll()
        stop_child(process, timeout=10.0)
        tail = log_tail(log_path, offset)
        if exited is not None and attempt < attempts and _PORT_IN_USE.search(tail):
            continue
        state = (
            f"exited with code {exited}"
            if exited is not None
            else f"was not ready after {time.monotonic() - started:.0f}s"
        )
        raise ServerStartError(f"{name} on 127.0.0.1:{chosen} {state}. Log {log_path}:\n{tail}")
    raise AssertionError("unreachable")
