"""hub/: the hub admin's files, checked as far as this machine can without a cluster, and the
parts of scripts/check_hub.py (``make check-hub``) that start nothing.

- ``hub/config.yaml`` loads and every key it sets is one the Zero to JupyterHub chart documents,
  with the type it documents: :data:`CHART` restates, for the keys used here, the chart's
  ``jupyterhub/values.schema.yaml`` (z2jh 4.4.0; ``additionalProperties: false`` where the chart
  has it, so a misspelt key fails), and :data:`PROFILE_KEYS` / :data:`OVERRIDE_TRAITS`
  KubeSpawner's ``profile_list`` help and the Spawner traits the profiles override. (Checked
  once against the chart itself: ``values.yaml`` + ``hub/config.yaml`` validates against the
  whole 4.4.0 schema with jsonschema.)
- the Slurm hub's config runs, offers 1, 2, 4 and 8 GPUs through ``req_ngpus``, and its batch
  script, rendered as batchspawner renders it, passes ``bash -n`` for every profile;
- ``hub/build_book.py`` gives every chapter of the book built for a hub one launch button, the exact
  nbgitpuller link, and leaves the default config without one; ``check_hub`` reads that link from
  the page once it has loaded, even when the browser's ``get()`` returns before (headless Chromium;
  skipped without it).
"""

import copy
import functools
import http.server
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")
jinja2 = pytest.importorskip("jinja2")

ROOT = Path(__file__).resolve().parent.parent
HUB = ROOT / "hub"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


book = _load("build_book", HUB / "build_book.py")
sys.path.insert(0, str(ROOT / "scripts"))
check_hub = _load("check_hub", ROOT / "scripts" / "check_hub.py")
check_book = sys.modules["check_book"]  # scripts/check_book.py, imported by check_hub

# --- the chart's schema, for the keys hub/config.yaml sets --------------------------------------------

NULLABLE_STRING = {"type": ["string", "null"]}
CHART = {
    # values.schema.yaml, top level: additionalProperties false, these properties
    "type": "object", "additionalProperties": False,
    "properties": {**{k: {} for k in (
        "enabled", "fullnameOverride", "nameOverride", "imagePullSecret", "imagePullSecrets", "proxy",
        "scheduling", "ingress", "httpRoute", "prePuller", "custom", "debug", "rbac", "global")},
        # hub: additionalProperties false; hub.shutdownOnLogout: boolean or null
        "hub": {"type": "object", "properties": {"shutdownOnLogout": {"type": ["boolean", "null"]}}},
        # cull: additionalProperties false, required enabled (boolean); timeout integer or null
        "cull": {"type": "object", "additionalProperties": False, "required": ["enabled"], "properties": {
            "enabled": {"type": "boolean"}, "timeout": {"type": ["integer", "null"]},
            **{k: {} for k in ("users", "adminUsers", "removeNamedServers", "every", "concurrency", "maxAge")}}},
        # singleuser: additionalProperties false, these 31 properties
        "singleuser": {"type": "object", "additionalProperties": False, "properties": {
            **{k: {} for k in (
                "allowPrivilegeEscalation", "cloudMetadata", "cmd", "cpu", "events", "extraAnnotations",
                "extraContainers", "extraFiles", "extraLabels", "extraNodeAffinity", "extraPodAffinity",
                "extraPodAntiAffinity", "extraPodConfig", "extraResource", "extraTolerations", "fsGid",
                "initContainers", "lifecycleHooks", "networkPolicy", "networkTools", "nodeSelector",
                "podNameTemplate", "serviceAccountName", "startTimeout", "uid")},
            # singleuser.image: additionalProperties false, required name and tag (strings)
            "image": {"type": "object", "additionalProperties": False, "required": ["name", "tag"],
                      "properties": {"name": {"type": "string"}, "tag": {"type": "string"},
                                     "pullPolicy": {}, "pullSecrets": {}}},
            "defaultUrl": NULLABLE_STRING,  # string or null
            "extraEnv": {"type": ["object", "array"]},
            # singleuser.memory: additionalProperties false; limit, guarantee: number, string or null
            "memory": {"type": "object", "additionalProperties": False, "properties": {
                "limit": {"type": ["number", "string", "null"]}, "guarantee": {"type": ["number", "string", "null"]}}},
            # singleuser.storage: additionalProperties false; extraVolumes(Mounts): object, array or null
            "storage": {"type": "object", "additionalProperties": False, "properties": {
                **{k: {} for k in ("capacity", "dynamic", "extraLabels", "homeMountPath", "static", "type")},
                "extraVolumes": {"type": ["object", "array", "null"]},
                "extraVolumeMounts": {"type": ["object", "array", "null"]}}},
            "profileList": {"type": "array"},  # a passthrough to KubeSpawner.profile_list
        }},
    },
}
PROFILE_KEYS = {"display_name", "slug", "description", "default", "kubespawner_override", "profile_options"}
"""The keys of one profile (kubespawner/spawner.py, ``profile_list``'s help)."""
OVERRIDE_TRAITS = {"cpu_guarantee", "cpu_limit", "mem_guarantee", "mem_limit",  # jupyterhub.spawner.Spawner
                   "extra_resource_limits"}  # kubespawner.KubeSpawner
"""The traits the profiles override, and the classes that define them."""
UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _bytes(quantity: str) -> int:
    """A Kubernetes quantity (``64G``, ``16Gi``) in bytes."""
    number, unit = re.fullmatch(r"(\d+)([KMGT]i?)?", str(quantity)).groups()
    return int(number) * UNITS[unit or ""]


@pytest.fixture(scope="module")
def values():
    return yaml.safe_load((HUB / "config.yaml").read_text())


def test_config_keys_are_the_charts(values):
    jsonschema.validate(values, CHART)
    misspelt = copy.deepcopy(values)
    misspelt["singleuser"]["profileLists"] = misspelt["singleuser"].pop("profileList")
    with pytest.raises(jsonschema.ValidationError, match="profileLists"):
        jsonschema.validate(misspelt, CHART)
    for profile in values["singleuser"]["profileList"]:
        assert set(profile) <= PROFILE_KEYS, profile["display_name"]
        assert set(profile["kubespawner_override"]) <= OVERRIDE_TRAITS, profile["display_name"]


def test_override_traits_are_spawner_traits():
    spawner = pytest.importorskip("jupyterhub.spawner", reason="the hub extra is not installed here")
    traits = spawner.Spawner.class_trait_names()
    assert OVERRIDE_TRAITS - {"extra_resource_limits"} <= set(traits)


def test_profiles_of_1_2_4_8_gpus_with_room_for_nccl(values):
    single = values["singleuser"]
    profiles = single["profileList"]
    gpus = [p["kubespawner_override"]["extra_resource_limits"]["nvidia.com/gpu"] for p in profiles]
    assert gpus == ["1", "2", "4", "8"]  # strings, as Kubernetes resource limits are written
    assert [p.get("default", False) for p in profiles] == [True, False, False, False]
    assert len({p["slug"] for p in profiles}) == 4
    volumes, mounts = single["storage"]["extraVolumes"], single["storage"]["extraVolumeMounts"]
    shm = [v for v in volumes.values() if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(shm) == 1
    assert [m["name"] for m in mounts.values() if m["mountPath"] == "/dev/shm"] == [shm[0]["name"]]
    size = _bytes(shm[0]["emptyDir"]["sizeLimit"])
    assert size >= 8 * 2**30  # 1 GiB per GPU of the largest profile: 128 x a container's 64 MB
    for profile, n in zip(profiles, (1, 2, 4, 8)):
        over = profile["kubespawner_override"]
        assert _bytes(over["mem_limit"]) >= 2 * size  # /dev/shm counts against the memory limit
        assert _bytes(over["mem_guarantee"]) <= _bytes(over["mem_limit"])
        assert over["cpu_limit"] >= 2 * n and over["cpu_guarantee"] <= over["cpu_limit"]
    assert single["memory"]["limit"] == profiles[0]["kubespawner_override"]["mem_limit"]


def test_the_image_is_the_dockerfiles(values):
    dockerfile = (HUB / "Dockerfile").read_text()
    image = values["singleuser"]["image"]
    assert f"-t {image['name']}:{image['tag']} ." in dockerfile
    base = re.search(r"^FROM (\S+)$", dockerfile, re.M).group(1)
    assert ":" in base and not base.endswith(":latest")
    assert "--file environment.yml" in dockerfile and '-c requirements.lock -e ".[hub]"' in dockerfile
    assert (ROOT / "environment.yml").is_file()
    extras = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {r.split(">")[0] for r in extras["hub"]} == {"jupyterhub", "nbgitpuller"}
    ignored = (HUB / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".git", "_build"} <= set(ignored)


# --- the Slurm hub ---------------------------------------------------------------------------------

SUBVARS = {  # what batchspawner passes to the template: each req_<name> trait as <name>, and cmd
    "username": "learner1", "homedir": "/home/learner1", "keepvars": "PATH,LANG,JUPYTERHUB_API_TOKEN",
    "queue": "", "host": "", "options": "", "epilogue": "", "cluster": "", "qos": "", "srun": "srun",
    "reservation": "", "gres": "", "keepvars_extra": "", "cmd": "jupyterhub-singleuser --debug",
}


@pytest.fixture(scope="module")
def slurm():
    from traitlets.config import Config

    c = Config()
    path = HUB / "jupyterhub_config_slurm.py"
    exec(compile(path.read_text(), str(path), "exec"), {"get_config": lambda: c, "__file__": str(path)})
    return c


def test_slurm_profiles_ask_for_1_2_4_8_gpus(slurm, values):
    assert slurm.JupyterHub.spawner_class == "wrapspawner.ProfilesSpawner"
    profiles = slurm.ProfilesSpawner.profiles
    assert [(key, cls) for _, key, cls, _ in profiles] == [(f"gpu-{n}", "batchspawner.SlurmSpawner") for n in (1, 2, 4, 8)]
    assert [traits["req_ngpus"] for *_, traits in profiles] == ["1", "2", "4", "8"]
    k8s = [p["kubespawner_override"] for p in values["singleuser"]["profileList"]]
    assert [(t["req_nprocs"], t["req_memory"]) for *_, t in profiles] == [(str(o["cpu_limit"]), o["mem_limit"]) for o in k8s]
    for shown, *_, traits in profiles:
        assert shown.startswith(f"{traits['req_ngpus']} GPU")


def _render(slurm, traits: dict) -> str:
    variables = {**SUBVARS, "prologue": slurm.SlurmSpawner.req_prologue,
                 **{k.removeprefix("req_"): v for k, v in traits.items()}}
    return jinja2.Template(slurm.SlurmSpawner.batch_script, undefined=jinja2.StrictUndefined).render(**variables)


def test_the_batch_script_passes_bash_n_for_every_profile(slurm, tmp_path):
    for _, key, _, traits in slurm.ProfilesSpawner.profiles:
        script = _render(slurm, traits)
        assert "{{" not in script and "{%" not in script
        sbatch = re.findall(r"^#SBATCH (.+)$", script, re.M)
        assert f"--gres=gpu:{traits['req_ngpus']}" in sbatch
        assert f"--cpus-per-task={traits['req_nprocs']}" in sbatch and f"--mem={traits['req_memory']}" in sbatch
        assert "--nodes=1" in sbatch and not any("account" in s for s in sbatch)  # ACCOUNT is empty
        assert re.search(r"^srun jupyterhub-singleuser --debug$", script, re.M)
        path = tmp_path / f"{key}.sh"
        path.write_text(script)
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    broken = tmp_path / "broken.sh"
    broken.write_text(_render(slurm, slurm.ProfilesSpawner.profiles[0][3]).replace("echo \"jupyterhub", "if echo \"x"))
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True).returncode != 0  # the check can fail


# --- the book for a hub -------------------------------------------------------------------------------

HUB_URL, REPO_URL = "https://hub.example.org", "https://github.com/ORG/fsdp-handbook"


def test_launch_url_is_nbgitpullers_link():
    assert book.launch_url(HUB_URL + "/", REPO_URL, "notebooks/01_model_and_parameters.ipynb") == (
        "https://hub.example.org/hub/user-redirect/git-pull?repo=https%3A//github.com/ORG/fsdp-handbook"
        "&urlpath=lab/tree/fsdp-handbook/notebooks/01_model_and_parameters.ipynb&branch=main")


def test_hub_config_adds_the_hubs_keys_and_changes_nothing_else():
    base = yaml.safe_load((ROOT / "_config.yml").read_text())
    # the default book: no hub and no repository, so the theme makes no launch button
    assert "jupyterhub_url" not in base["launch_buttons"] and "repository" not in base
    assert not any(base["launch_buttons"].get(k) for k in ("binderhub_url", "colab_url", "thebe"))
    config = book.hub_config(base, HUB_URL, REPO_URL, "course")
    assert config["launch_buttons"] == {**base["launch_buttons"], "jupyterhub_url": HUB_URL}
    assert config["repository"] == {"url": REPO_URL, "branch": "course"}
    assert config["sphinx"]["local_extensions"] == {
        k: str((ROOT / v).resolve()) for k, v in base["sphinx"]["local_extensions"].items()}
    rest = {k: v for k, v in config.items() if k not in ("launch_buttons", "repository", "sphinx")}
    assert rest == {k: v for k, v in base.items() if k not in ("launch_buttons", "sphinx")}
    assert config["sphinx"]["config"] == base["sphinx"]["config"]  # GitHub: no provider to name
    local = book.hub_config(base, "http://127.0.0.1:8765", "git://127.0.0.1:9418/fsdp-handbook")
    assert local["sphinx"]["config"] == {**base["sphinx"]["config"],
                                         "html_theme_options": {"repository_provider": "github"}}
    assert local["sphinx"]["recursive_update"] is True
    assert base == yaml.safe_load((ROOT / "_config.yml").read_text())  # not changed in place


@pytest.mark.parametrize("hub, repo, said", [
    ("hub.example.org", REPO_URL, "the hub URL must start with http:// or https://"),
    ("ftp://hub.example.org", REPO_URL, "the hub URL must start with http:// or https://"),
    ("https://", REPO_URL, "name a host"),
    (HUB_URL, "github.com/ORG/REPO", "the repository URL must be a git URL"),
    (HUB_URL, "https://github.com", "ending in the repository's name"),
])
def test_bad_urls_are_one_line(hub, repo, said):
    with pytest.raises(ValueError) as err:
        book.hub_config({}, hub, repo)
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def hub_html(tmp_path_factory):
    if not (Path(sys.executable).parent / "jupyter-book").exists():
        pytest.fail(f"jupyter-book is not installed beside {sys.executable}: run scripts/setup.sh")
    return book.build(tmp_path_factory.mktemp("hub_book"), HUB_URL, REPO_URL)


def test_every_chapter_has_one_launch_button(hub_html):
    from bs4 import BeautifulSoup

    from tests.test_book import external_urls_loaded

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages = [c["file"] for part in toc["parts"] for c in part["chapters"]]
    notebooks = [p for p in pages if (ROOT / f"{p}.ipynb").exists()]
    assert len(notebooks) >= 9
    for page in [toc["root"], *pages]:
        html = (hub_html / f"{page}.html").read_text()
        links = [a["href"] for a in BeautifulSoup(html, "html.parser").select("a")
                 if "/hub/user-redirect/git-pull" in a.get("href", "")]
        expected = [book.launch_url(HUB_URL, REPO_URL, f"{page}.ipynb")] if page in notebooks else []
        assert links == expected, page
        assert external_urls_loaded(html) == [], page  # the button is a link: nothing loaded off-site
    assert (hub_html / "_static" / "images" / "logo_jupyterhub.svg").exists()


SLOW_S = 1.0  # seconds between the head of a page and its body, from the test's server


@pytest.fixture
def eager_browser():
    """Headless Chromium whose ``get()`` returns as soon as the navigation starts (page load
    strategy "none"): what chromedriver's ``get()`` does now and then under "normal"."""
    reason = check_hub.missing_requirements()
    if reason:
        pytest.skip(f"no browser: {reason}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(b) for b in check_book.BROWSERS if shutil.which(b))
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(flag)
    options.page_load_strategy = "none"
    driver = webdriver.Chrome(options=options, service=Service(
        executable_path=next(shutil.which(d) for d in check_book.DRIVERS if shutil.which(d))))
    try:
        yield driver
    finally:
        driver.quit()


class _HeadFirst(http.server.SimpleHTTPRequestHandler):
    """Sends a page's ``<head>`` at once and the rest :data:`SLOW_S` later: a page that is still
    loading when ``get()`` has returned, as on a busy machine."""

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if path.suffix != ".html" or not path.is_file():
            return super().do_GET()
        data = path.read_bytes()
        cut = data.index(b"<body")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[:cut])
        self.wfile.flush()
        time.sleep(SLOW_S)
        self.wfile.write(data[cut:])

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@pytest.fixture
def slow_book(hub_html):
    """The hub's book on 127.0.0.1, each page's body sent :data:`SLOW_S` after its head; its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_HeadFirst, directory=str(hub_html)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_launch_links_are_read_once_the_page_has_loaded(eager_browser, slow_book):
    """``make check-hub`` failed 1 run in 3 with "launch links []" on chapter 1, a page that has
    the link: it read the page as soon as ``get()`` returned, and chromedriver's ``get()`` sometimes
    returns before the page has loaded. Here it always does (strategy "none", the body late)."""
    from selenium.webdriver.common.by import By

    chapter = "notebooks/01_model_and_parameters.ipynb"
    page = slow_book + chapter.removesuffix(".ipynb") + ".html"
    eager_browser.get(page)
    assert eager_browser.find_elements(By.CSS_SELECTOR, check_hub.LAUNCH_LINK) == []  # read too early: no body yet
    started = time.monotonic()
    assert check_hub.launch_links(eager_browser, page) == [book.launch_url(HUB_URL, REPO_URL, chapter)]
    assert time.monotonic() - started >= SLOW_S  # it waited for the server's answer
    assert eager_browser.execute_script("return document.title").startswith("1. ")
    with pytest.raises(check_hub.CheckFailed) as err:  # a page that does not load in time: named
        check_hub.launch_links(eager_browser, slow_book + "genindex.html", timeout_s=SLOW_S / 4)
    assert str(err.value) == f"{slow_book}genindex.html loaded: not within {SLOW_S / 4:g} s"


# --- scripts/check_hub.py: bad input, before anything starts ------------------------------------------

def test_check_hub_refuses_bad_hub_urls_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {
            "127.0.0.1:8765": "must start with http:// or https://",
            "https://127.0.0.1:8765": "it must be http://127.0.0.1:PORT",
            "http://10.1.2.3:8765": "it must be http://127.0.0.1:PORT",
            "http://127.0.0.1": "name a port",
            f"http://127.0.0.1:{port}": f"port {port} on 127.0.0.1 is in use",
        }
        for url, said in cases.items():
            with pytest.raises(check_hub.BadInput) as err:
                check_hub.check_hub_url(url)
            assert said in str(err.value) and "\n" not in str(err.value), url
    assert check_hub.check_hub_url(f"http://localhost:{port}/") == f"http://127.0.0.1:{port}"  # free again
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", check_hub.check_hub_url(None))


@pytest.fixture(scope="module")
def bare_repo(tmp_path_factory):
    """A repository holding one chapter on branch main, as file://."""
    root = tmp_path_factory.mktemp("repo")
    work = root / "work"
    (work / "notebooks").mkdir(parents=True)
    (work / "notebooks" / "01_x.ipynb").write_text("{}")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@127.0.0.1", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "x"]):
        subprocess.run(git + args, cwd=work, check=True, capture_output=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(root / "course.git")], check=True)
    return f"file://{root / 'course.git'}"


def test_check_hub_refuses_a_repository_nbgitpuller_cannot_clone(bare_repo, tmp_path):
    check_hub.check_clonable(bare_repo, "main", "notebooks/01_x.ipynb")  # clones: no error
    cases = [
        ((f"file://{tmp_path}/nothing", "main", "notebooks/01_x.ipynb"), "nbgitpuller cannot clone file://"),
        (("git://127.0.0.1:1/course", "main", "notebooks/01_x.ipynb"), "fatal: unable to connect to 127.0.0.1"),
        ((bare_repo, "course", "notebooks/01_x.ipynb"), "has no branch 'course'"),
        ((bare_repo, "main", "notebooks/02_y.ipynb"), "notebooks/02_y.ipynb is not in"),
        (("github.com/ORG/REPO", "main", "notebooks/01_x.ipynb"), "the repository URL must be a git URL"),
    ]
    for args, said in cases:
        with pytest.raises(check_hub.BadInput) as err:
            check_hub.check_clonable(*args)
        assert said in str(err.value) and "\n" not in str(err.value), args


def test_check_hub_main_says_one_line_and_starts_nothing(capsys):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert check_hub.main(["--hub-url", "hub.example.org"]) == 2
    assert check_hub.main(["--chapter", "notebooks/99_none.ipynb"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["check_hub: --hub-url: the hub URL must start with http:// or https:// and name a host, "
                   "e.g. https://hub.example.org; got 'hub.example.org'",
                   f"check_hub: --chapter: no notebooks/99_none.ipynb in {ROOT}"]
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before


def test_processes_are_found_by_the_folder_they_name(tmp_path):
    proc = subprocess.Popen(["sleep", "60"], cwd=tmp_path)
    try:
        assert proc.pid in {p.pid for p in check_hub.mentioning(str(tmp_path))}
        started = check_hub.Started()
        started.note(proc.pid)
        assert [p.pid for p in started.alive()] == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in {p.pid for p in check_hub.mentioning(str(tmp_path))}
    assert started.alive() == []
    assert shutil.which("git"), "git is needed by nbgitpuller and by these tests"
    assert json.loads(json.dumps(started.kinds())) == {"proxy": 0, "server": 0, "kernel": 0, "rank": 0}
