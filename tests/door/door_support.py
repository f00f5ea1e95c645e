"""Helpers for the tests of the door users know: a deployment of processes with the demo
pair (or a draft that never agrees), scraping /metrics with prometheus-client's own text
parser, and the target alone as the greedy reference."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from sdcp_fast import config as schema
from sdcp_fast.models import DEMO_DIR, load_backend
from sdcp_fast.models.weights import load_tiny, save_tiny
from sdcp_fast.procs import Cluster, free_port

TARGET, DRAFT = "tiny:demo-target", "tiny:demo-draft"
MODEL_NAME = "demo-target"


def never_agreeing_draft(workdir: Path) -> str:
    """The demo draft with its output layer zeroed: every logit is 0, so it always proposes
    token 0 (a NUL byte, which the target, trained on Python code, never picks)."""
    model, _ = load_tiny(DEMO_DIR / "demo-draft.safetensors")
    with torch.no_grad():
        model.output.weight.zero_()
    path = workdir / "poor-draft.safetensors"
    save_tiny(model, path)
    shutil.copy(DEMO_DIR / "tokenizer.json", workdir / "tokenizer.json")
    return f"tiny:{path}"


def demo_cluster(workdir: Path, *, drafters: int = 2, draft: str = DRAFT, contract: dict | None = None) -> Cluster:
    """Verifier, drafters and router as processes, each with /metrics and /health."""
    cluster = Cluster(workdir / "cluster")
    # speculation on: the toy target is so cheap that the cost plan would self-decode it
    cluster.verifier("verifier", model=TARGET, metrics=f"127.0.0.1:{free_port()}", max_wait_ms=1.0,
                     speculation="on")
    names = [f"drafter-{n}" for n in range(1, drafters + 1)]
    for name in names:
        cluster.drafter(name, model=draft, metrics=f"127.0.0.1:{free_port()}")
    digest = load_backend(draft).digest.hex()
    cluster.router(model=TARGET, drafter_models=dict.fromkeys(names, digest), contract=contract,
                   metrics=f"127.0.0.1:{free_port()}")
    return cluster


def wait_live(cluster: Cluster, timeout: float = 60.0) -> None:
    """Until the router's /health says ready with every verifier and drafter live."""
    router = cluster.instances["router"]
    want_v = sum(1 for i in cluster.instances.values() if i.role == "verifier")
    want_d = sum(1 for i in cluster.instances.values() if i.role == "drafter")
    deadline = time.monotonic() + timeout
    while True:
        try:
            health = httpx.get(f"{router.frontdoor_url}/health", timeout=5).json()
            if health.get("verifiers_live") == want_v and health.get("drafters_live") == want_d:
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not live: {health}")
        time.sleep(0.1)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, parsed by prometheus-client's text parser:
    {(sample name, sorted label pairs): value}."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metrics_url(cluster: Cluster, name: str) -> str:
    return f"http://127.0.0.1:{cluster.instances[name].info['metrics_port']}/metrics"


def greedy_text(prompt_ids: list[int], n: int) -> tuple[list[int], str]:
    """The target alone, greedy: n tokens after the prompt, and their text."""
    backend = load_backend(TARGET)
    backend.open(b"ref", prompt_ids)
    out = []
    for _ in range(n):
        token = int(torch.argmax(backend.score([(b"ref", [])])[-1]))
        backend.commit(b"ref", [token])
        out.append(token)
    return out, backend.decode(out)


def rewrite_ports(src: Path, dst: Path) -> dict[int, int]:
    """The example configs with each port replaced by a free one (ports are shared by the
    TOML files, so the same map serves all)."""
    texts = {p.name: p.read_text() for p in src.glob("*.toml")}
    ports = sorted({int(m) for t in texts.values() for m in re.findall(r"127\.0\.0\.1:(\d+)", t)})
    mapping = {port: free_port() for port in ports}
    dst.mkdir()
    for name, text in texts.items():
        text = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{mapping[int(m.group(1))]}", text)
        (dst / name).write_text(text)
        schema.loads(text, name)           # still a valid config
    return mapping


def start_up(*args: str) -> subprocess.Popen:
    """`sdcp-fast up ARGS` as a user starts it from a terminal, in a process group of its
    own, with Ctrl-C's default action even where the test run was started with SIGINT
    ignored (a background job of a shell without job control: the child inherits that, and
    Python then never raises KeyboardInterrupt)."""
    return subprocess.Popen([sys.executable, "-m", "sdcp_fast.cli", "up", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ready_line(proc: subprocess.Popen) -> str:
    """`up`'s stdout up to its ready line (progress lines come before it)."""
    said = []
    while True:
        line = proc.stdout.readline()
        said.append(line)
        if not line or line.startswith("OpenAI API at"):
            assert line, ("".join(said), proc.stderr.read() if proc.poll() is not None else "")
            return line


def interrupt(proc: subprocess.Popen, timeout: float = 30) -> int:
    """Ctrl-C, as a user stops `up`: its exit code (its group killed, and the test failed,
    if it does not stop within `timeout`)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def start_example(example: Path, tmp_path: Path, served: str, timeout: float = 120):
    """`sdcp-fast up EXAMPLE` with every port of its configs made a free one and its work
    directory in tmp_path/work; its ready line must end with `served` ("(model ...)").
    Returns (the process, an openai client of its front door)."""
    import openai

    front = rewrite_ports(example, tmp_path / "deployment")[8000]
    proc = start_up(str(tmp_path / "deployment"), "--workdir", str(tmp_path / "work"))
    try:
        line = ready_line(proc)
        assert line == f"OpenAI API at http://127.0.0.1:{front}/v1 {served}\n", line
    except BaseException:
        interrupt(proc)
        raise
    return proc, openai.OpenAI(base_url=f"http://127.0.0.1:{front}/v1", api_key="unused", max_retries=0,
                               timeout=timeout)
