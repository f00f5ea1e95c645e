"""The command line as an operator meets it: every error is one line on stderr, no
traceback, exit code 2; --version; serve --help lists every member; digest --model; the
logs in JSON; `sdcp-fast up` with the example deployment, driven by the openai client."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdcp_fast import config as schema
from sdcp_fast import logs
from sdcp_fast.models import load_backend
from sdcp_fast.ports import free_port
from sdcp_fast.transport import make_certs

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def cli(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sdcp_fast.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def verifier_config(tmp_path: Path, **changes) -> Path:
    """A verifier's config with working certificates, store and log (changes: members)."""
    port = free_port()
    uri = f"https://127.0.0.1:{port}/"
    make_certs(tmp_path / "certs", [uri])
    text = (f'role = "verifier"\nuri = "{uri}"\ncerts = "{tmp_path / "certs"}"\nmodel = "tiny:demo-target"\n'
            f'store = "embedded:{tmp_path / "mlc"}"\ncommit_log = "file:{tmp_path / "log"}"\n')
    for key, value in changes.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {json.dumps(value)}", text, flags=re.M) \
            if re.search(rf"^{key} = ", text, re.M) else text + f"{key} = {json.dumps(value)}\n"
    text += '[verifier]\nrouters = ["https://127.0.0.1:1/"]\n'
    path = tmp_path / "v.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------- errors: one line, exit 2


def test_digest_with_a_prompt_that_is_not_token_ids():
    assert_one_line_error(cli("digest", str(EXAMPLES / "contract.json"), "--prompt", "hello"),
                          "--prompt", "token ids")


def test_digest_of_a_missing_contract_file(tmp_path):
    assert_one_line_error(cli("digest", str(tmp_path / "nope.json")), "nope.json", "No such file")


def test_digest_of_a_contract_that_does_not_parse(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    assert_one_line_error(cli("digest", str(bad)), "c.json", "does not parse")


def test_digest_of_a_model_that_does_not_exist(tmp_path):
    assert_one_line_error(cli("digest", "--model", f"tiny:{tmp_path / 'missing.safetensors'}"),
                          "cannot be loaded", "missing.safetensors")


def test_serve_with_a_missing_config_file(tmp_path):
    assert_one_line_error(cli("serve", "verifier", "--config", str(tmp_path / "none.toml")), "none.toml")


def test_serve_with_a_misspelt_member_names_the_closest_one(tmp_path):
    config = verifier_config(tmp_path)
    config.write_text(config.read_text() + "max_bacth = 8\n")
    assert_one_line_error(cli("serve", "verifier", "--config", str(config)),
                          "unknown member 'max_bacth'", "did you mean 'max_batch'?")


def test_serve_with_a_missing_certificate_directory(tmp_path):
    config = verifier_config(tmp_path, certs=str(tmp_path / "no-certs"))
    assert_one_line_error(cli("serve", "verifier", "--config", str(config)), "certs", "no-certs")


def test_serve_with_a_wrong_model_path(tmp_path):
    config = verifier_config(tmp_path, model="tiny:/nowhere/model.safetensors")
    assert_one_line_error(cli("serve", "verifier", "--config", str(config)), "tiny:/nowhere/model.safetensors",
                          "cannot be loaded")


def test_serve_on_a_port_in_use(tmp_path):
    config = verifier_config(tmp_path)
    port = int(re.search(r":(\d+)/", config.read_text()).group(1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        done = cli("serve", "verifier", "--config", str(config))
    assert_one_line_error(done, f"127.0.0.1:{port}", "in use")


def test_serve_with_a_metrics_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = verifier_config(tmp_path)
        config.write_text(config.read_text() + f'metrics = "127.0.0.1:{port}"\n')
        done = cli("serve", "verifier", "--config", str(config))
    assert_one_line_error(done, "metrics", f"127.0.0.1:{port}", "in use")


def test_serve_with_a_bad_log_format(tmp_path):
    config = verifier_config(tmp_path, log_format="xml")
    assert_one_line_error(cli("serve", "verifier", "--config", str(config)), "log_format")


def test_up_with_a_directory_without_configs(tmp_path):
    assert_one_line_error(cli("up", str(tmp_path)), "no *.toml")


# ---------------------------------------------------------------------- what operators ask for


def test_version():
    done = cli("--version")
    assert done.returncode == 0 and re.fullmatch(r"sdcp-fast \d+\.\d+\.\d+\S*\n", done.stdout)


def test_serve_help_lists_every_member_of_every_role():
    done = cli("serve", "--help")
    assert done.returncode == 0
    for cls in (schema.InstanceConfig, *schema.SECTIONS.values(), schema.ContractSection, schema.DrafterEntry):
        for name, _, _ in schema.members(cls):
            if cls is schema.InstanceConfig and re.search(rf"^\[{name}\]", done.stdout, re.M):
                continue                               # a table (a role's, [transport]), listed below
            assert re.search(rf"^\s+{name}\s", done.stdout, re.M), name
    assert "docs/CONFIG.md" in done.stdout


def test_config_reference_page_is_up_to_date():
    """docs/CONFIG.md holds `config.reference()` verbatim."""
    assert schema.reference() in (REPO / "docs" / "CONFIG.md").read_text()


def test_digest_of_a_model():
    done = cli("digest", "--model", "tiny:demo-draft")
    backend = load_backend("tiny:demo-draft")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"model_digest     {backend.digest.hex()}",
                                        f"tokenizer_digest {backend.tokenizer_digest.hex()}",
                                        f"vocab_size       {backend.vocab_size}"]


def test_json_logs(tmp_path):
    """log_format = "json": every line of the log is a JSON object (the instance stops at
    once here, on a port in use, after logging)."""
    config = verifier_config(tmp_path, log_format="json", log_level="debug")
    port = int(re.search(r":(\d+)/", config.read_text()).group(1))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        done = cli("serve", "verifier", "--config", str(config))
    assert done.returncode == 2
    *logged, error = done.stderr.strip().splitlines()
    records = [json.loads(line) for line in logged]
    assert records and all({"time", "level", "role", "logger", "message"} <= set(r) for r in records)
    assert error.startswith("sdcp-fast serve: ")


def test_info_keeps_the_chatty_libraries_quiet():
    """At INFO an instance's log says what the instance did: transformers and httpx say
    nothing below WARNING; at DEBUG httpx speaks again."""
    transformers = pytest.importorskip("transformers")
    hf_log = transformers.utils.logging.get_logger("transformers.modeling_utils")
    root = logging.getLogger()
    saved = root.level, list(root.handlers), {name: logging.getLogger(name).level for name in logs.CHATTY}
    out = io.StringIO()
    try:
        transformers.utils.logging.set_verbosity_info()    # as a library or an env var may have set it
        logs.setup("info", role="verifier", stream=out)
        quiet = not hf_log.isEnabledFor(logging.INFO) and hf_log.isEnabledFor(logging.WARNING)
        logging.getLogger("httpx").info("HTTP Request: POST https://127.0.0.1:1/status")
        logging.getLogger("sdcp_fast.verifier").info("ready")
        logs.setup("debug", role="verifier", stream=out)
        logging.getLogger("httpx").debug("HTTP Request: GET https://127.0.0.1:1/health")
    finally:
        root.setLevel(saved[0])
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[1]:
            root.addHandler(handler)
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)
    said = out.getvalue()
    assert quiet
    assert "POST https://127.0.0.1:1/status" not in said
    assert "verifier INFO sdcp_fast.verifier: ready" in said
    assert "GET https://127.0.0.1:1/health" in said


@pytest.mark.parametrize(("args", "words"), [
    (["--target", "nope:x"], ["--target nope:x", "unknown model kind"]),
    (["--target", "hf:/no/such/dir"], ["--target hf:/no/such/dir", "not found"]),
    (["--target", "tiny:demo-target", "--draft", "tiny:/no/such.safetensors"], ["--draft", "not found"]),
    (["--target", "tiny:demo-target", "--draft", "ngram:smollm2"], ["tokenizer is not the target's"]),
    (["--target", "tiny:/no/file.safetensors", "--draft", "tiny:demo-draft"], ["--target", "not found"]),
    (["--target", "tiny:demo-target", "--max-model-len", "64"], ["--max-model-len needs an hf: target"]),
    (["--max-model-len", "0"], ["--max-model-len must be a positive integer"]),
    (["--drafters", "0"], ["--drafters must be at least 1"]),
    (["--drafters", "two"], ["--drafters", "invalid int value"]),
    (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    (["--logprobs-mode", "raw_logits"], ["--logprobs-mode", "invalid choice"]),
    ([str(EXAMPLES / "deployment"), "--target", "tiny:demo-target"], ["--target: only without DIR"]),
])
def test_up_bad_flags_and_specs_are_one_line(args, words):
    assert_one_line_error(cli("up", "--port", "0", *args), *words)


def test_up_on_a_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert_one_line_error(cli("up", "--port", str(port)), f"127.0.0.1:{port} is in use")


@pytest.mark.parametrize(("args", "words"), [
    (["--pair", "tiny", "--target", "tiny:demo-target"], ["real pair"]),
    (["--target", "nope:x"], ["cannot load", "unknown model kind"]),
    (["--drafters", "0"], ["--drafters must be at least 1"]),
])
def test_demo_bad_flags_and_specs_are_one_line(args, words):
    assert_one_line_error(cli("demo", *args), *words)


def test_up_help_shows_the_common_cases():
    done = cli("up", "--help")
    assert done.returncode == 0
    for words in ("sdcp-fast up ", "--target tiny:demo-target", "--draft", "--served-model-name", "--max-model-len",
                  "--drafters", "examples/deployment-real"):
        assert words in done.stdout, words


@pytest.mark.timeout(180)
def test_up_with_the_demo_pair_serves_it(tmp_path):
    """`sdcp-fast up --target tiny:demo-target`: the demo pair (here on any free port, one
    drafter), greedy output identical to the target alone; Ctrl-C stops every process and
    removes the temporary work directory."""
    import openai
    from door_support import greedy_text, interrupt, ready_line, start_up

    proc = start_up("--target", "tiny:demo-target", "--port", "0", "--drafters", "1")
    try:
        starting = proc.stderr.readline()
        workdir = Path(re.search(r"\(logs in (.+)\)", starting).group(1))
        line = ready_line(proc)
        api = re.fullmatch(r"OpenAI API at (http://127\.0\.0\.1:\d+/v1) \(model demo-target: target "
                           r"tiny:demo-target, draft tiny:demo-draft x 1\)\n", line)
        assert api, (starting, line, proc.stderr.read() if proc.poll() is not None else "")
        client = openai.OpenAI(base_url=api.group(1), api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["demo-target"]
        prompt = "def main():\n    "
        _, want = greedy_text(load_backend("tiny:demo-target").encode(prompt), 16)
        r = client.completions.create(model="demo-target", prompt=prompt, max_tokens=16, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "length")
        pids = {ready.stem: json.loads(ready.read_text())["pid"] for ready in workdir.glob("*.ready")}
        assert sorted(pids) == ["drafter-1", "router", "verifier"]
    finally:
        code = interrupt(proc)
    assert code == 0
    assert not workdir.exists()
    time.sleep(0.2)
    for name, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), name


# ---------------------------------------------------------------------- sdcp-fast up examples/deployment


@pytest.mark.timeout(180)
def test_up_starts_the_example_deployment_and_serves_the_openai_api(tmp_path):
    from door_support import interrupt, start_example

    proc, client = start_example(EXAMPLES / "deployment", tmp_path,
                                 "(model demo-target: target tiny:demo-target, draft tiny:demo-draft x 2)")
    try:
        r = client.chat.completions.create(model="demo-target", max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "def main():"}])
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
        assert sorted(p.name for p in (tmp_path / "work").glob("*.log")) == \
            ["drafter-1.log", "drafter-2.log", "router.log", "verifier.log"]
        assert (tmp_path / "work" / "certs" / "ca.pem").is_file()
    finally:
        code = interrupt(proc)
    assert code == 0
    time.sleep(0.2)
    for ready in (tmp_path / "work").glob("*.ready"):
        pid = json.loads(ready.read_text())["pid"]
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), ready
    shutil.rmtree(tmp_path / "work", ignore_errors=True)
