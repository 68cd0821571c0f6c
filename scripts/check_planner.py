"""The book's planner page in headless Chromium: the same numbers as ``plan --json``, fast enough.

Called by ``scripts/check_book.py`` (``make check-book``) on the built book, served over HTTP. It
opens ``book/planner.html``, waits for the first answer (the runtime loads when the widget comes
into view) and checks, each an offender when it fails:

- the first answer within :data:`FIRST_ANSWER_S` seconds, printed;
- for each of :data:`CONFIGS` (presets, a pasted ``config.json``, every layout and policy, bad
  input), the page's answer against ``python -m handbook_lib plan ... --json`` for the same flags
  (run in this process): the report equal (:func:`same`), or for bad input the same one-line error;
- a change typed into the GPU count redrawn within :data:`CHANGE_MS` milliseconds, the last good
  answer kept under a bad one;
- no wider than the window at 800 px;
- opened from ``file://``, a one-line message saying how to serve the folder;
- embedded in chapter 4 (:data:`EMBEDDED`): started only once in view, and answering there.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

FIRST_ANSWER_S = 5.0
CHANGE_MS = 300.0
PAGE = "book/planner.html"
LLAMA3_8B = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_configs" / "llama3-8b.json"

_BASE = {"gpu": "h100-80gb"}
CONFIGS: list[dict[str, Any]] = [
    {"model": "llama2-7b", "gpus": "8"},
    {"model": "llama2-13b", "gpus": "16", "seq_len": "4096"},
    {"model": "llama2-70b", "gpus": "32", "seq_len": "4096"},
    {"model": "llama2-70b", "gpus": "64", "seq_len": "4096", "micro_batch": "2", "precision": "fp32"},
    {"model": "llama3-405b", "gpus": "1024", "seq_len": "8192"},
    {"model": "gpt3-175b", "gpu": "a100-80gb", "gpus": "64", "seq_len": "2048", "sensitivity": True},
    {"model": "llama2-7b", "gpu": "a100-40gb", "gpus": "8", "headroom": "0.1", "optimizer": "sgd-momentum"},
    {"model": "llama2-70b", "gpu": "a100-80gb", "gpus": "16", "seq_len": "4096", "optimizer_impl": "fused"},
    {"model": "llama2-7b", "gpus": "8", "seq_len": "4096", "grad_accum": "4"},
    {"model": "llama2-13b", "gpus": "16", "grad_accum": "8", "sync_every_micro_step": True},
    {"model": "llama2-7b", "gpus": "8", "sync_every_micro_step": True},
    {"model": "llama2-70b", "gpu": "a100-80gb", "gpus": "16", "seq_len": "4096", "precision": "bf16"},
    {"model": "llama2-70b", "gpu": "h200-141gb", "gpus": "16", "seq_len": "8192", "inter_link": "100gbe",
     "nics_per_node": "1"},
    {"model": "llama2-70b", "gpus": "64", "seq_len": "131072", "tp_size": "8", "sp_size": "8"},
    {"model": "llama2-70b", "gpus": "64", "seq_len": "131072", "sp_size": "8", "sp_method": "ring"},
    {"model": "llama2-70b", "gpus": "256", "seq_len": "8192", "batch_tokens": "1048576"},
    {"model": "llama2-70b", "gpus": "64", "seq_len": "4096", "tp_size": "8", "pp_size": "2"},
    {"model": "llama3-405b", "gpus": "1024", "seq_len": "8192", "pp_size": "1"},
    {"model": "llama2-13b", "gpu": "mi300x-192gb", "gpus": "8", "gpus_per_node": "8"},
    {"config": "llama3-8b", "gpus": "16", "seq_len": "8192"},
    {"config": "llama3-8b", "gpus": "64", "seq_len": "65536", "sp_size": "4", "sp_method": "ulysses"},
    {"model": "llama2-70b", "gpus": "64", "seq_len": "4096", "shard_group_size": "0"},
    {"model": "llama2-70b", "gpus": "64", "seq_len": "4096", "shard_group_size": "16",
     "activation_checkpointing": "selective", "ac_matmul_every": "2"},
    {"model": "llama2-13b", "gpus": "16", "seq_len": "8192", "activation_checkpointing": "selective",
     "ac_save": "matmul"},
    {"model": "llama2-7b", "gpus": "8", "seq_len": "8192", "ac_every": "2"},
    {"config": "llama3-8b", "gpus": "16", "seq_len": "8192", "loss_chunks": "8"},
    {"model": "llama2-70b", "gpus": "8", "loss_chunks": "3"},
    {"model": "llama2-70b", "gpus": "64", "shard_group_size": "12"},
    {"model": "llama2-70b", "gpus": "64", "ac_save": "attention"},
    {"model": "llama2-70b", "gpus": "0"},
    {"model": "llama2-70b", "gpus": "12"},
    {"model": "llama2-70b", "gpus": "16", "tp_size": "3"},
    {"config": "{not json", "gpus": "8"},
]
"""The page's fields for each comparison (``gpu`` defaults to ``h100-80gb``; ``config`` names a
file of ``tests/data/hf_configs`` or is pasted text)."""


def same(a: Any, b: Any) -> bool:
    """``a`` equals ``b``, every number to :data:`DIGITS` significant digits: WebAssembly's C library
    (musl) and glibc round some functions differently in the last bit (one ulp, measured on the
    layouts' step times), which is all that differs."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    numbers = (int, float)  # JavaScript has one number type: 0.0 comes back from the page as 0
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b or abs(a - b) <= 10 ** -DIGITS * max(abs(a), abs(b))
    return a == b and type(a) is type(b)


DIGITS = 12
"""Significant digits to which the page's numbers equal ``plan --json``'s."""


def _argv(fields: dict[str, Any], config_file: Path) -> list[str]:
    argv = ["plan"]
    if fields.get("config"):
        argv += ["--hf-config", str(config_file)]
    else:
        argv += ["--model", fields["model"]]
    for key, value in fields.items():
        if key in ("model", "config") or value in ("", None, False):
            continue
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return argv + ["--json"]


def _cli(fields: dict[str, Any], folder: Path) -> tuple[dict | None, str]:
    """``plan --json`` for the page's ``fields``, in this process: (report, ``""``) or (None, the error)."""
    from handbook_lib.face import main

    config_file = folder / "config.json"
    if fields.get("config"):
        text = fields["config"]
        config_file.write_text(LLAMA3_8B.read_text() if text == "llama3-8b" else text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(_argv(fields, config_file))
    if code:
        line = " ".join(err.getvalue().split()).removeprefix("error: ").split(" (see:")[0]
        return None, line.replace(str(config_file), "config.json")
    return json.loads(out.getvalue()), ""


def check_planner(driver, base: str, html_dir: Path) -> list[tuple[str, str]]:
    """The planner page's checks (module docstring): ``(check, detail)`` for each offence."""
    found: list[tuple[str, str]] = []
    driver.get(base + "/" + PAGE)
    start = time.perf_counter()
    first = None
    while time.perf_counter() - start < 60 and first is None:
        first = driver.execute_script("return window.hbPlanner && window.hbPlanner.firstAnswerMs")
        time.sleep(0.05)
    if first is None:
        return [("planner", "no answer within 60 s: " + driver.find_element("id", "hb-status").text)]
    print(f"check_book: the planner's first answer {first / 1000:.1f} s after the page asked")
    if first > 1000 * FIRST_ANSWER_S:
        found.append(("planner", f"first answer after {first / 1000:.1f} s, over {FIRST_ANSWER_S:.0f} s"))
    with tempfile.TemporaryDirectory() as tmp:
        for fields in CONFIGS:
            page_fields = {**_BASE, **fields}
            if fields.get("config") == "llama3-8b":
                page_fields["config"] = LLAMA3_8B.read_text()
            page = driver.execute_script("return window.hbPlanner.ask(arguments[0])", page_fields)
            report, error = _cli({**_BASE, **fields}, Path(tmp))
            if report is not None and not same(page.get("report"), report):
                found.append(("planner", f"{fields}: the page's report differs from plan --json's"))
            if report is None and not (page.get("error") and error.startswith(page["error"][:60])):
                found.append(("planner", f"{fields}: page {page.get('error')!r}, plan {error!r}"))
    found += _typing(driver)
    found += _embedded(driver, base)
    driver.set_window_size(800, 900)
    wide = driver.execute_script("return document.documentElement.scrollWidth > window.innerWidth")
    if wide:
        found.append(("planner", "wider than an 800 px window"))
    driver.set_window_size(1400, 900)
    driver.get((html_dir / PAGE).resolve().as_uri())
    time.sleep(0.5)
    driver.execute_script("document.getElementById('hb-planner').scrollIntoView()")
    time.sleep(0.5)
    text = driver.find_element("id", "hb-planner").text
    if "serve the built book" not in text:
        found.append(("planner", f"opened from file://, it says {text!r}"))
    return found


def _typing(driver) -> list[tuple[str, str]]:
    """A new GPU count typed into the form: redrawn within CHANGE_MS; a bad one keeps the last answer."""
    found = []
    for value in ("16", "64"):
        driver.execute_script("const f = document.querySelector('#hb-form [name=gpus]'); f.value = arguments[0];"
                              "f.dispatchEvent(new Event('input', {bubbles: true}));", value)
        last = driver.execute_script("return window.hbPlanner.last")
        command = last["result"]["command"] if last else ""
        if f"--gpus {value}" not in command:
            found.append(("planner", f"typing {value} GPUs did not redraw the plan ({command!r})"))
        elif last["ms"] > CHANGE_MS:
            found.append(("planner", f"a change took {last['ms']:.0f} ms, over {CHANGE_MS:.0f}"))
    driver.execute_script("const f = document.querySelector('#hb-form [name=gpus]'); f.value = '0';"
                          "f.dispatchEvent(new Event('input', {bubbles: true}));")
    shown = driver.find_element("css selector", ".hb-error[data-for=gpus]").text
    kept = "--gpus 64" in driver.find_element("id", "hb-answer").text
    if "argument --gpus" not in shown or not kept:
        found.append(("planner", f"a bad GPU count: error {shown!r} beside the field, last answer kept: {kept}"))
    return found


EMBEDDED = "notebooks/04_choosing_a_strategy.html"
"""A chapter that embeds the widget (where chapter 4 introduces the planner)."""


def _embedded(driver, base: str) -> list[tuple[str, str]]:
    """The widget in a chapter: it starts once scrolled into view and answers there too."""
    driver.get(base + "/" + EMBEDDED)
    if driver.execute_script("return window.hbPlanner && window.hbPlanner.ready") is not None:
        return [("planner", f"{EMBEDDED}: the runtime started before the widget was in view")]
    driver.execute_script("document.getElementById('hb-planner').scrollIntoView()")
    start = time.perf_counter()
    while time.perf_counter() - start < 60:
        if driver.execute_script("return window.hbPlanner && window.hbPlanner.firstAnswerMs"):
            return []
        time.sleep(0.05)
    return [("planner", f"{EMBEDDED}: no answer within 60 s of scrolling to the widget")]
