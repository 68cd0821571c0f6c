"""Run a chapter through a real JupyterHub on 127.0.0.1, as a learner does (``make check-hub``).

    python scripts/check_hub.py [--hub-url http://127.0.0.1:PORT] [--repo-url URL] [--branch main]
                                [--chapter notebooks/01_model_and_parameters.ipynb] [--timeout-s 900]

In order, everything on 127.0.0.1, in one temporary folder removed at the end:

1. the course: without ``--repo-url``, this working tree (tracked files and untracked ones git
   does not ignore) is committed into a bare repository, served by ``git daemon`` as
   ``git://127.0.0.1:PORT/fsdp-handbook``: the remote nbgitpuller clones, as it would clone
   GitHub on a real hub;
2. the book, built for that hub and that repository (``hub/build_book.py``: every chapter with its
   JupyterHub launch button), served by Python's http.server;
3. JupyterHub (PyPI) behind configurable-http-proxy (npm), with ``DummyAuthenticator`` and
   ``SimpleLocalProcessSpawner``: each learner is a hub user with a server and a home folder of
   their own (not a system account); logging out stops the learner's server;
4. a learner, in headless Chromium (Selenium): opens the chapter's page in the book, finds its
   JupyterHub button (the link must be the nbgitpuller link :func:`book.launch_url` computes),
   follows it, logs in, waits for the server to start and nbgitpuller to clone the course into
   their home, sees JupyterLab open the chapter, runs every cell (Run > Run All Cells), saves
   it, shuts its kernel down and logs out;
5. checks: every code cell ran, no cell's output is an error (read from the saved notebook in
   the learner's home), a ``torchrun`` run among the cells finished, the hub reports the
   learner's server stopped after the logout;
6. the hub is stopped (it stops the proxy and any server), then the git daemon; no process
   whose command line, folder or environment names the temporary folder may remain, nor any
   process the hub started (psutil): any left is killed, named, and fails the check.

Bad input stops it before anything starts, with one line and exit status 2: a hub URL that is
not ``http://127.0.0.1:PORT`` (no scheme, another host), a port already in use, a repository URL
nbgitpuller cannot clone (``git ls-remote`` fails or lacks the branch), a chapter not in the
repository, or a missing requirement (``scripts/setup.sh book,test,lab,hub,browser``, Chromium
and its driver, ``npm install --prefix .venv/node configurable-http-proxy``: the Makefile
target installs them all). Exit status 1: a check failed; 0: all held.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit
from urllib.request import Request, urlopen

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "hub")]
import build_book as book  # noqa: E402 - hub/build_book.py
from check_book import chrome, missing_requirements, serve, wait_until_loaded  # noqa: E402 - a sibling script

HOST = "127.0.0.1"
VENV_BIN = Path(sys.executable).parent
PROXY = ROOT / ".venv" / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
CHAPTER = "notebooks/01_model_and_parameters.ipynb"
FOLDER = "fsdp-handbook"  # the repository's name: the folder nbgitpuller clones into
LEARNER = "learner1"
TOKEN_BYTES = 32
LAUNCH_LINK = 'a[href*="/hub/user-redirect/git-pull"]'  # the JupyterHub button, as CSS


class BadInput(ValueError):
    """One line for the user: nothing was started."""


class CheckFailed(RuntimeError):
    """A check did not hold."""


# --- the arguments, checked before anything starts ------------------------------------------------

def port_free(port: int) -> bool:
    """True if nothing listens on ``HOST:port`` (and this process may bind it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port the OS says is free on ``HOST`` now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def check_hub_url(url: str | None) -> str:
    """The hub's URL, ``http://127.0.0.1:PORT`` (a free port when ``url`` is None).

    Raises:
        BadInput: no scheme, not http, not this machine's loopback, or a port in use.
    """
    if url is None:
        return f"http://{HOST}:{free_port()}"
    try:
        url = book.check_hub_url(url)
    except ValueError as err:
        raise BadInput(f"--hub-url: {err}") from None
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in (HOST, "localhost") or parts.path not in ("", "/"):
        raise BadInput(f"--hub-url: this check starts its hub here, so it must be http://{HOST}:PORT; got {url!r}")
    if parts.port is None:
        raise BadInput(f"--hub-url: name a port, e.g. http://{HOST}:8765; got {url!r}")
    if not port_free(parts.port):
        raise BadInput(f"--hub-url: port {parts.port} on {HOST} is in use: pick another, or leave "
                       "--hub-url out for a free one")
    return f"http://{HOST}:{parts.port}"


def _git_error(stderr: str) -> str:
    """git's own line for what went wrong: its first ``fatal:`` line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()] or ["no output"]
    at = next((i for i, line in enumerate(lines) if line.startswith("fatal:")), len(lines) - 1)
    said = lines[at]
    return f"{said} {lines[at + 1]}" if said.endswith(":") and at + 1 < len(lines) else said


def check_clonable(repo_url: str, branch: str, chapter: str, timeout_s: float = 60.0) -> None:
    """Refuse a repository nbgitpuller could not clone: it runs ``git ls-remote`` and ``git
    clone --depth 1 --branch``; the chapter must be in it.

    Raises:
        BadInput: one line, with git's last line of error.
    """
    try:
        repo_url = book.check_repo_url(repo_url)
    except ValueError as err:
        raise BadInput(f"--repo-url: {err}") from None
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    try:
        done = subprocess.run(["git", "ls-remote", "--heads", "--", repo_url], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise BadInput(f"--repo-url: nbgitpuller cannot clone {repo_url}: git ls-remote took over "
                       f"{timeout_s:.0f} s") from None
    if done.returncode != 0:
        raise BadInput(f"--repo-url: nbgitpuller cannot clone {repo_url}: {_git_error(done.stderr)}")
    if f"refs/heads/{branch}" not in done.stdout.split():
        raise BadInput(f"--repo-url: {repo_url} has no branch {branch!r} for nbgitpuller to clone")
    with tempfile.TemporaryDirectory(prefix="check-hub-probe-") as probe:
        clone = subprocess.run(["git", "clone", "-q", "--depth", "1", "--branch", branch, "--", repo_url, probe],
                               capture_output=True, text=True, timeout=600, env=env)
        if clone.returncode != 0:
            raise BadInput(f"--repo-url: nbgitpuller cannot clone {repo_url}: {_git_error(clone.stderr)}")
        if not (Path(probe) / chapter).is_file():
            raise BadInput(f"--chapter: {chapter} is not in {repo_url} ({branch})")


def missing() -> str | None:
    """What this check needs and does not find here, or None."""
    reason = missing_requirements()
    if reason:
        return reason
    for program in ("jupyterhub", "jupyterhub-singleuser"):
        if not (VENV_BIN / program).exists():
            return f"{program} is not installed: scripts/setup.sh book,test,lab,hub,browser"
    try:
        import nbgitpuller  # noqa: F401
        import psutil  # noqa: F401
    except ImportError as err:
        return f"{err.name} is not installed: scripts/setup.sh book,test,lab,hub,browser"
    if not PROXY.exists():
        return "configurable-http-proxy is not installed: npm install --prefix .venv/node configurable-http-proxy"
    if not shutil.which("git"):
        return "git is not installed"
    return None


# --- the processes this check starts, and what they leave ------------------------------------------

@dataclass
class Started:
    """Every process this check started or saw started under it, by pid and start time."""

    seen: dict[int, tuple[float, str]] = field(default_factory=dict)

    def note(self, pid: int) -> None:
        """Record ``pid`` and every process under it now."""
        import psutil

        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                self.seen.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline())[:300]))
        except psutil.Error:
            pass

    def kinds(self) -> dict[str, int]:
        """How many of each kind were seen: proxy, server, kernel, rank (of a torchrun run)."""
        marks = {"proxy": "configurable-http-proxy", "server": "jupyterhub-singleuser",
                 "kernel": "ipykernel_launcher", "rank": "handbook_lib.runs."}
        return {kind: sum(mark in line for _, line in self.seen.values()) for kind, mark in marks.items()}

    def alive(self) -> list:
        """Those still running (the same process: same pid and start time)."""
        import psutil

        out = []
        for pid, (created, _) in self.seen.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                continue
        return out


def mentioning(text: str) -> list:
    """Processes other than this one whose command line, folder or environment mention ``text``."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        if p.pid == os.getpid():
            continue
        try:
            hay = " ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")
            if text in hay or any(text in v for v in p.environ().values()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def leftovers(started: Started, tmp: Path, wait_s: float = 20.0) -> list[str]:
    """Wait up to ``wait_s`` for every process of the check to end; kill and name those that do not."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        left = {p.pid: p for p in started.alive() + mentioning(str(tmp))
                + psutil.Process().children(recursive=True)}  # the browser and its driver too
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    named = []
    for p in left.values():
        try:
            named.append(f"pid {p.pid}: {' '.join(p.cmdline())[:100]}")
            p.kill()
        except psutil.Error:
            continue
    return named


def _spawn(command: list[str], log: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``command`` in its own session, its output into ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tail(log: Path | None) -> str:
    """The end of ``log`` on lines of its own after the message, or nothing without a log."""
    return "\n" + log.read_text(errors="replace")[-2000:] if log else ""


def _wait_for(what: str, test, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll ``test()`` until it returns something true; raise naming ``what`` (and the log's end)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = test()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise CheckFailed(f"{what}: the process exited with {proc.returncode}{_tail(log)}")
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: not within {timeout_s:g} s{_tail(log)}")
        time.sleep(0.25)


# --- the course, served by git ------------------------------------------------------------------

def snapshot(dest: Path) -> Path:
    """This working tree (tracked files and untracked ones git does not ignore), committed into a
    bare repository ``dest/FOLDER.git`` on branch ``main``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    work = dest / "work"
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, work / name)
    git = ["git", "-c", "user.name=check-hub", "-c", f"user.email=check-hub@{HOST}", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "check-hub snapshot"]):
        subprocess.run(git + args, cwd=work, check=True, capture_output=True)
    bare = dest / "srv" / f"{FOLDER}.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True, capture_output=True)
    shutil.rmtree(work)
    return bare


def start_git_daemon(srv: Path, port: int, log: Path) -> subprocess.Popen:
    """``git daemon`` serving every repository under ``srv`` on ``git://HOST:port/NAME``."""
    return _spawn(["git", "daemon", "--reuseaddr", f"--listen={HOST}", f"--port={port}", "--export-all",
                   f"--base-path={srv}", str(srv)], log, srv, dict(os.environ))


# --- the hub ----------------------------------------------------------------------------------------

def hub_config(tmp: Path, hub_url: str, token: str) -> str:
    """``jupyterhub_config.py`` for the local hub (everything on 127.0.0.1, state in ``tmp``)."""
    port = urlsplit(hub_url).port
    args = ["--LabApp.expose_app_in_browser=True"] + (["--allow-root"] if os.geteuid() == 0 else [])
    return f"""\
# Written by scripts/check_hub.py: a throwaway hub on {HOST}, every file in {tmp}.
c = get_config()  # noqa: F821
c.JupyterHub.ip = {HOST!r}
c.JupyterHub.port = {port}
c.JupyterHub.hub_ip = {HOST!r}
c.JupyterHub.hub_port = {free_port()}
c.ConfigurableHTTPProxy.api_url = "http://{HOST}:{free_port()}"
c.ConfigurableHTTPProxy.command = [{str(PROXY)!r}]
c.ConfigurableHTTPProxy.pid_file = {str(tmp / "proxy.pid")!r}
c.JupyterHub.db_url = "sqlite:///{tmp / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = {str(tmp / "cookie_secret")!r}
c.JupyterHub.pid_file = {str(tmp / "hub.pid")!r}
c.JupyterHub.authenticator_class = "dummy"   # any name, any password: for tests only
c.Authenticator.allow_all = True
c.JupyterHub.spawner_class = "simple"        # a server and a home folder per hub user
c.SimpleLocalProcessSpawner.home_dir_template = {str(tmp / "home" / "{username}")!r}
c.Spawner.cmd = [{str(VENV_BIN / "jupyterhub-singleuser")!r}]
c.Spawner.args = {args!r}
c.Spawner.default_url = "/lab"
c.Spawner.environment = {{"NBGITPULLER_APP": "lab"}}
c.Spawner.env_keep = ["PATH", "LANG", "LC_ALL", "HANDBOOK_DEVICE", "OMP_NUM_THREADS"]
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.JupyterHub.shutdown_on_logout = True       # logging out stops the learner's server
c.JupyterHub.cleanup_servers = True          # stopping the hub stops every server
c.JupyterHub.cleanup_proxy = True            # ... and the proxy it started
c.JupyterHub.services = [{{"name": "check-hub", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "check-hub", "scopes": ["read:users", "read:servers"],
                            "services": ["check-hub"]}}]
"""


def hub_api(hub_url: str, token: str, path: str) -> dict:
    """GET ``/hub/api/<path>`` with the check's service token; the parsed JSON."""
    request = Request(f"{hub_url}/hub/api/{path}", headers={"Authorization": f"token {token}"})
    with urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _hub_up(hub_url: str, token: str) -> bool:
    try:
        return "version" in hub_api(hub_url, token, "")
    except OSError:
        return False


@contextmanager
def hub(tmp: Path, hub_url: str, started: Started) -> Iterator[tuple[str, subprocess.Popen]]:
    """JupyterHub and its proxy running on ``hub_url``; stopped on exit (it stops the servers)."""
    token = os.urandom(TOKEN_BYTES).hex()
    folder = tmp / "hub"
    folder.mkdir()
    (folder / "jupyterhub_config.py").write_text(hub_config(tmp, hub_url, token))
    env = {**os.environ, "PATH": os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")])}
    log = tmp / "hub.log"
    proc = _spawn([str(VENV_BIN / "jupyterhub"), "-f", str(folder / "jupyterhub_config.py")], log, folder, env)
    try:
        _wait_for("the hub answering on " + hub_url, lambda: _hub_up(hub_url, token), 90, proc, log)
        started.note(proc.pid)
        yield token, proc
    finally:
        started.note(proc.pid)
        _stop(proc)


# --- the learner ----------------------------------------------------------------------------------

_LAB_STATE = """
const app = window.jupyterapp;
if (!app) return null;
const nb = app.shell.currentWidget;
if (!nb || !nb.content || !nb.content.widgets || !nb.context) return {path: null};
const kernel = nb.sessionContext && nb.sessionContext.session && nb.sessionContext.session.kernel;
const cells = nb.content.widgets.filter((w) => w.model.type === "code");
const prompts = cells.map((w) => (w.promptNode ? w.promptNode.textContent : ""));
return {path: nb.context.path, kernel: kernel ? kernel.status : null, dirty: nb.context.model.dirty,
        code: cells.length, ran: cells.filter((w) => w.model.executionCount !== null).length,
        busy: prompts.filter((p) => p.includes("*")).length,
        errors: cells.filter((w) => w.model.outputs.toJSON().some((o) => o.output_type === "error")
                                    && !(w.model.getMetadata("tags") || []).includes("raises-exception")).length};
"""


def _menu(driver, menu: str, command: str) -> None:
    """Click ``menu`` in JupyterLab's menu bar, then its item running ``command``."""
    from selenium.webdriver.common.by import By

    bar = [e for e in driver.find_elements(By.CSS_SELECTOR, "#jp-MainMenu .lm-MenuBar-itemLabel")
           if e.text.strip() == menu]
    if not bar:
        raise CheckFailed(f"JupyterLab shows no {menu!r} menu")
    bar[0].click()
    try:
        item = _wait_for(f"the {menu} menu's item {command}", lambda: [
            e for e in driver.find_elements(By.CSS_SELECTOR, f'.lm-Menu-item[data-command="{command}"]')
            if e.is_displayed()], 10)
    except CheckFailed:
        shown = [e.get_attribute("data-command") for e in driver.find_elements(By.CSS_SELECTOR, ".lm-Menu-item")
                 if e.is_displayed()]
        raise CheckFailed(f"JupyterLab's {menu} menu has no {command}; it shows {shown}") from None
    item[0].click()


def _accept_dialog(driver, timeout_s: float = 10.0) -> None:
    """Click the accept button of JupyterLab's dialog, if one comes."""
    from selenium.webdriver.common.by import By

    try:
        button = _wait_for("a dialog", lambda: [e for e in driver.find_elements(
            By.CSS_SELECTOR, ".jp-Dialog .jp-mod-accept") if e.is_displayed()], timeout_s)
        button[0].click()
    except CheckFailed:
        pass


def open_page(driver, url: str, timeout_s: float = 30.0) -> None:
    """Open ``url`` and wait for its load event: chromedriver's ``get()`` sometimes returns before
    it, and the DOM read then is the blank tab's or half the page's (no launch link yet).

    Raises:
        CheckFailed: the browser is not on ``url`` with the page loaded within ``timeout_s`` s.
    """
    driver.get(url)
    try:
        wait_until_loaded(driver, url, timeout_s)
    except TimeoutError:
        raise CheckFailed(f"{url} loaded: not within {timeout_s:g} s") from None


def launch_links(driver, page: str, timeout_s: float = 30.0) -> list[str]:
    """The nbgitpuller links (``href``) on the book's ``page``, read once it has loaded."""
    from selenium.webdriver.common.by import By

    open_page(driver, page, timeout_s)
    return [a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, LAUNCH_LINK)]


def learner_session(driver, book_base: str, hub_url: str, repo_url: str, branch: str, chapter: str,
                    timeout_s: float, log, watch) -> dict:
    """What a learner does, from the book's page to logging out; what the browser showed.
    ``watch()`` is called while the cells run (to record the processes under the hub)."""
    from selenium.webdriver.common.by import By

    page = book_base + quote(chapter.removesuffix(".ipynb")) + ".html"
    links = launch_links(driver, page)
    expected = book.launch_url(hub_url, repo_url, chapter, branch)
    if links != [expected]:
        raise CheckFailed(f"{page}: launch links {links}, expected [{expected}]")
    driver.find_element(By.CSS_SELECTOR, 'button[aria-label="Launch interactive content"]').click()
    _wait_for("the JupyterHub button under the rocket",
              driver.find_element(By.CSS_SELECTOR, LAUNCH_LINK).is_displayed, 10)
    log(f"the book's JupyterHub button: {expected}")
    driver.get(expected)  # the button opens a new tab; the learner's path is the same
    _wait_for("the hub's login page", lambda: driver.find_elements(By.ID, "username_input"), 30)
    driver.find_element(By.ID, "username_input").send_keys(LEARNER)
    driver.find_element(By.ID, "password_input").send_keys("any password")
    driver.find_element(By.ID, "login_submit").click()
    log(f"logged in as {LEARNER}; waiting for the server and nbgitpuller")
    state = _wait_for("JupyterLab open on the chapter", lambda: (
        (s := driver.execute_script(_LAB_STATE)) and s.get("path") == f"{FOLDER}/{chapter}"
        and s.get("kernel") == "idle" and s), 240)
    lab_url = driver.current_url
    _menu(driver, "Edit", "editmenu:clear-all")  # so that a stored output is not taken for a run
    _wait_for("the outputs cleared", lambda: driver.execute_script(_LAB_STATE)["ran"] == 0, 30)
    log(f"JupyterLab at {lab_url}: {state['code']} code cells; Run > Run All Cells")
    _menu(driver, "Run", "runmenu:run-all")
    started = time.monotonic()

    def finished():
        watch()
        s = driver.execute_script(_LAB_STATE)
        if s["errors"] or (s["ran"] == s["code"] and not s["busy"] and s["kernel"] == "idle"):
            return s
        return None

    state = _wait_for("every cell run", finished, timeout_s)
    run_s = time.monotonic() - started
    log(f"ran {state['ran']}/{state['code']} code cells in {run_s:.0f} s, {state['errors']} with an error")
    _menu(driver, "File", "docmanager:save")
    _wait_for("the notebook saved", lambda: not driver.execute_script(_LAB_STATE)["dirty"], 30)
    _menu(driver, "Kernel", "kernelmenu:shutdown")
    _accept_dialog(driver)
    _wait_for("the kernel shut down", lambda: driver.execute_script(_LAB_STATE)["kernel"] in (None, "dead"), 30)
    _menu(driver, "File", "hub:logout")
    _wait_for("the hub's login page after logging out", lambda: driver.find_elements(By.ID, "username_input")
              or "logout" in driver.current_url, 30)
    return {"lab_url": lab_url, "run_s": run_s, **state}


def check_saved(path: Path) -> list[str]:
    """What is wrong with the notebook the learner saved: cells not run, errors, no torchrun run."""
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    problems = [f"cell {i}: not run" for i, c in enumerate(code) if c.get("execution_count") is None]
    for i, c in enumerate(code):
        tags = c.get("metadata", {}).get("tags", [])
        errors = [o for o in c.get("outputs", []) if o["output_type"] == "error"]
        if errors and "raises-exception" not in tags:
            problems.append(f"code cell {i}: {errors[0]['ename']}: {errors[0]['evalue'][:100]}")
    runs = [c for c in code if "torchrun(" in "".join(c["source"]) and c.get("outputs")]
    if not runs:
        problems.append("no cell started a torchrun run that showed an output")
    return problems


# --- it all, in order --------------------------------------------------------------------------------

def run_check(hub_url: str, repo_url: str | None, branch: str, chapter: str, timeout_s: float) -> int:
    """The check; the exit status (0 all held, 1 a check failed)."""
    t0 = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {message}", flush=True)

    started = Started()
    problems: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="check-hub-"))
    daemon = None
    try:
        if repo_url is None:
            bare = snapshot(tmp)
            git_port = free_port()
            daemon = start_git_daemon(bare.parent, git_port, tmp / "git-daemon.log")
            repo_url = f"git://{HOST}:{git_port}/{FOLDER}"
            _wait_for("git daemon serving the course", lambda: subprocess.run(
                ["git", "ls-remote", "--heads", repo_url], capture_output=True).returncode == 0, 30, daemon,
                tmp / "git-daemon.log")
            started.note(daemon.pid)
            log(f"this working tree, committed and served at {repo_url}")
        html = book.build(tmp / "book", hub_url, repo_url, branch)
        log(f"the book built for {hub_url} and {repo_url}")
        with hub(tmp, hub_url, started) as (token, hub_proc), serve(html) as book_base, chrome() as driver:
            log(f"JupyterHub {hub_api(hub_url, token, '')['version']} on {hub_url}")
            seen = learner_session(driver, book_base, hub_url, repo_url, branch, chapter, timeout_s, log,
                                   lambda: started.note(hub_proc.pid))
            kinds = started.kinds()
            log(f"seen under the hub while the cells ran: {kinds}")
            for kind in ("proxy", "server", "kernel", "rank"):
                if not kinds.get(kind):
                    problems.append(f"no {kind} process was seen under the hub while the cells ran")
            user = hub_api(hub_url, token, f"users/{LEARNER}")
            if user.get("servers"):
                problems.append(f"after logging out, the hub still lists {LEARNER}'s servers: {list(user['servers'])}")
            saved = tmp / "home" / LEARNER / FOLDER / chapter
            if not saved.is_file():
                problems.append(f"nbgitpuller left no {FOLDER}/{chapter} in {LEARNER}'s home")
            else:
                problems += check_saved(saved)
            if seen["errors"]:
                problems.append(f"JupyterLab showed {seen['errors']} cell(s) with an error")
        log("the hub stopped")
    except CheckFailed as err:
        problems.append(str(err))
    finally:
        _stop(daemon)
        named = leftovers(started, tmp)
        problems += [f"left running, now killed: {line}" for line in named]
        if not named:
            log(f"no process left ({len(started.seen)} started under the check, all gone)")
        shutil.rmtree(tmp, ignore_errors=True)
    for line in problems:
        print(f"check_hub: {line}", file=sys.stderr)
    verdict = "all held" if not problems else f"{len(problems)} problem(s)"
    print(f"check_hub: {chapter} through JupyterHub: {verdict}, {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub-url", help=f"where the hub listens (default: http://{HOST}:<a free port>)")
    parser.add_argument("--repo-url", help="the course's repository, as nbgitpuller clones it (default: this "
                        "working tree, served by git daemon)")
    parser.add_argument("--branch", default="main", help="its branch (default: main)")
    parser.add_argument("--chapter", default=CHAPTER, help=f"the notebook the learner runs (default: {CHAPTER})")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="seconds for its cells (default: 900)")
    args = parser.parse_args(argv)
    try:
        hub_url = check_hub_url(args.hub_url)
        if args.repo_url is not None:
            check_clonable(args.repo_url, args.branch, args.chapter)
        elif not (ROOT / args.chapter).is_file():
            raise BadInput(f"--chapter: no {args.chapter} in {ROOT}")
        reason = missing()
        if reason:
            raise BadInput(f"cannot run: {reason}")
    except BadInput as err:
        print(f"check_hub: {err}", file=sys.stderr)
        return 2
    return run_check(hub_url, args.repo_url, args.branch, args.chapter, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
