"""`sdcp-fast up [DIR]`: a whole deployment on one machine, serving the OpenAI API until
interrupted (what `vllm serve MODEL` is to vLLM: one command to an endpoint).

Without DIR: the real pair, as `make demo` runs it: the target `hf:smollm2`
(SmolLM2-135M-Instruct through transformers, fp32; the first run converts its GGUF into
$SDCP_CACHE, with a progress line) on a verifier, `--drafters` drafters running the draft
`demo.real_pair.choose_draft` picks (the native int8 twin `twin:smollm2` where it is built,
with 8-bit activations where the CPU has 8-bit dot products),
and a router whose front door listens at --host:--port. `--target SPEC` and `--draft SPEC`
choose other models (`--target tiny:demo-target`: the byte-level demo pair shipped in the
package, whose draft is `tiny:demo-draft`); a target other than those two needs `--draft`.
`--served-model-name` names the model in the API (default: from the target spec, e.g.
`smollm2`), `--max-model-len` caps a session's length (an `hf:` target's `max_seq_len`).
Both models are loaded here first: a spec that does not load, or a draft whose tokenizer is
not the target's, is one line on stderr and exit code 2 before any process starts. Every
instance has its /metrics and /health on a port of its own.

With DIR: one instance per `*.toml` file there (each with its `role`; examples/deployment
and examples/deployment-real are such directories). Relative paths in those files are
relative to the work directory, where certificates are made for every instance unless its
certs directory already holds the operator's CA certificate without the CA key.

Each instance is an `sdcp-fast serve` process with its log in the work directory. Loading
the models says so on stdout (a progress line); once every instance serves and the router
sees a verifier and a drafter live, one line is printed there:

    OpenAI API at http://HOST:PORT/v1 (model NAME: target SPEC, draft SPEC x N)

Ctrl-C (or SIGTERM) stops every process. An instance that exits early ends `up` with its
reason (the last line of its log) and exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, load
from .procs import Cluster, Instance

POLL_S = 0.5
REAL_TARGET = "hf:smollm2"
TINY_TARGET, TINY_DRAFT = "tiny:demo-target", "tiny:demo-draft"


@dataclass(frozen=True)
class Served:
    """What the ready line says: the API's model name, the target, the drafts."""

    name: str
    target: str
    drafts: tuple[str, ...]

    def line(self, api: str) -> str:
        kinds = sorted(set(self.drafts))
        drafts = ", ".join(f"{d} x {self.drafts.count(d)}" for d in kinds)
        return f"OpenAI API at {api} (model {self.name}: target {self.target}, draft {drafts})"


@dataclass(frozen=True)
class Pair:
    """The models `up` serves without DIR, checked: specs as the instances load them."""

    target: str
    draft: str
    draft_digest: str
    why: str                # why this draft

    @property
    def real(self) -> bool:
        return not self.target.startswith("tiny:")


def with_option(spec: str, key: str, value: int) -> str:
    return f"{spec}{'&' if '?' in spec else '?'}{key}={value}"


def choose_pair(target: str | None, draft: str | None, max_model_len: int | None) -> Pair:
    """Resolve and load the pair (the first load of the real target converts its GGUF,
    with a progress line). Raises ConfigError (one line, exit code 2) for a spec that does
    not load, a missing draft, a draft with another tokenizer."""
    from .demo.real_pair import choose_draft, progress
    from .models import load_backend
    from .models.real_tokenizer import cache_dir

    target = target or REAL_TARGET
    if max_model_len is not None:
        if max_model_len < 1:
            raise ConfigError("--max-model-len must be a positive integer")
        if not target.startswith("hf:"):
            raise ConfigError(f"--max-model-len needs an hf: target (it sets max_seq_len), not {target!r}")
        target = with_option(target, "max_seq_len", max_model_len)
    slow = target.startswith("hf:")
    # progress lines go to stdout (as the demo's), before the ready line: stderr says only what went wrong
    with progress(f"loading the target {target}" + (
            f" (the first run converts the GGUF to fp32 into {cache_dir()}: 30-100 s)" if slow else "")):
        target_model = _load(load_backend, target, "--target")
        tokenizer = target_model.tokenizer_digest
        del target_model   # the verifier and the router load their own
    why = "given with --draft"
    if draft is None:
        if target == TINY_TARGET:
            draft, why = TINY_DRAFT, "the demo pair's draft"
        elif target.partition("?")[0] == REAL_TARGET:
            draft, why = choose_draft()
        else:
            raise ConfigError(f"--target {target}: give its draft with --draft SPEC (a model with the same "
                              "tokenizer, e.g. ngram:SOURCE for prompt lookup)")
    with progress(f"loading the draft {draft}"):
        draft_model = _load(load_backend, draft, "--draft")
    if draft_model.tokenizer_digest != tokenizer:
        raise ConfigError(f"--draft {draft}: its tokenizer is not the target's ({target})")
    return Pair(target, draft, draft_model.digest.hex(), why)


def _load(load_backend, spec: str, flag: str):
    if spec.startswith("hf:"):
        with contextlib.suppress(ImportError):   # its weight-loading bar would be a line on stderr
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
    try:
        return load_backend(spec)
    except Exception as exc:   # a bad spec, a missing file or package: the user's input
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{flag} {spec}: cannot load it: {reason}") from None


def plan_pair(cluster: Cluster, pair: Pair, host: str, port: int, drafters: int, name: str,
              logprobs_mode: str = "raw_logprobs") -> Served:
    """Verifier, drafters and router (the demo's deployment, demo/deployment.py) with a
    front door at host:port and every instance's /metrics and /health on a port of its own."""
    from .demo import deployment

    deployment.plan(cluster, pair.target, pair.draft, pair.draft_digest, deployment.UP_MAX_NEW,
                    slow=pair.real, drafters=drafters, rounds_log=False, metrics=True,
                    frontdoor=f"{host}:{port}", served_model_name=name, logprobs_mode=logprobs_mode)
    return Served(name, pair.target, (pair.draft,) * drafters)


def plan_dir(cluster: Cluster, directory: Path) -> Served:
    from .serve import served_model_name

    files = sorted(directory.glob("*.toml"))
    if not files:
        raise ConfigError(f"{directory}: no *.toml instance configs")
    for path in files:
        cfg = load(path)
        if not cfg.role:
            raise ConfigError(f"{path.name}: needs a role (verifier, drafter or router) to be started by up")
        cluster.add(path.stem, cfg)
    roles = [i.role for i in cluster.instances.values()]
    if roles.count("router") != 1:
        raise ConfigError(f"{directory}: needs exactly one router config, found {roles.count('router')}")
    router = next(i for i in cluster.instances.values() if i.role == "router")
    if not router.config.router.frontdoor:
        raise ConfigError(f"{router.config_path.name}: the router needs a frontdoor to serve the OpenAI API")
    name = router.config.router.served_model_name or served_model_name(router.config.model)
    return Served(name, router.config.model,
                  tuple(i.config.model for i in cluster.instances.values() if i.role == "drafter"))


def check_args(args: argparse.Namespace) -> None:
    """Flags that choose the models apply without DIR only."""
    if args.dir:
        given = [flag for flag, value in (("--target", args.target), ("--draft", args.draft),
                                          ("--served-model-name", args.served_model_name),
                                          ("--max-model-len", args.max_model_len)) if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only without DIR (DIR's configs name the models)")
    if args.drafters < 1:
        raise ConfigError("--drafters must be at least 1")
    if not args.dir and args.port and not port_free(args.host, args.port):
        raise ConfigError(f"{args.host}:{args.port} is in use (--port N for another port, --port 0 for any free one)")


def port_free(host: str, port: int) -> bool:
    """Whether the front door could listen at host:port now (checked before the models load)."""
    import socket

    try:
        with socket.create_server((host, port)):
            return True
    except OSError:
        return False


def main(args: argparse.Namespace) -> int:
    def terminate(signum, frame):    # SIGTERM as Ctrl-C: clean up once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    try:
        check_args(args)
        if args.dir:
            directory = Path(args.dir)
            if not directory.is_dir():
                raise ConfigError(f"{args.dir}: no such directory")
            pair = None
        else:
            pair = choose_pair(args.target, args.draft, args.max_model_len)
    except ConfigError as exc:
        print(f"sdcp-fast up: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    keep = args.workdir is not None
    root = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="sdcp-up-"))
    cluster = Cluster(root, protocol=args.protocol)
    try:
        if pair is None:
            served = plan_dir(cluster, directory.resolve())
        else:
            from .serve import served_model_name

            name = args.served_model_name or served_model_name(pair.target)
            served = plan_pair(cluster, pair, args.host, args.port, args.drafters, name, args.logprobs_mode)
            print(f"draft {pair.draft}: {pair.why}", flush=True)
        return serve_until_interrupted(cluster, served, slow=pair is not None and pair.real)
    except ConfigError as exc:
        print(f"sdcp-fast up: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sdcp-fast up: stopping", file=sys.stderr)
        return 0
    finally:
        cluster.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def serve_until_interrupted(cluster: Cluster, served: Served, *, slow: bool = False) -> int:
    print(f"sdcp-fast up: starting {len(cluster.instances)} instances (logs in {cluster.workdir})",
          file=sys.stderr, flush=True)
    try:
        cluster.start(timeout=600 if slow else 120)
    except (RuntimeError, TimeoutError) as exc:
        failed = next((i for i in cluster.instances.values() if i.popen and not i.alive()), None)
        why = _last_line(failed) if failed else str(exc).splitlines()[0]
        print(f"sdcp-fast up: {failed.name if failed else 'start'} failed: {why}", file=sys.stderr)
        return 1
    router = next(i for i in cluster.instances.values() if i.role == "router")
    host = router.config.router.frontdoor.rpartition(":")[0] or "127.0.0.1"
    api = f"http://{host}:{router.info['frontdoor_port']}/v1"
    if not wait_live(router, cluster, timeout=180 if slow else 60):
        return 1
    print(served.line(api), flush=True)
    while True:
        time.sleep(POLL_S)
        for instance in cluster.instances.values():
            if not instance.alive():
                print(f"sdcp-fast up: {instance.name} exited ({instance.popen.returncode}): "
                      f"{_last_line(instance)}", file=sys.stderr)
                return 1


def wait_live(router: Instance, cluster: Cluster, timeout: float = 60.0) -> bool:
    """Until the router's /health says ready with a verifier and a drafter live."""
    import httpx

    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{router.info['frontdoor_port']}/health"
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = httpx.get(url, timeout=5).json()
            if health.get("status") == "ok" and health.get("verifiers_live") and health.get("drafters_live"):
                return True
        for instance in cluster.instances.values():
            if not instance.alive():
                print(f"sdcp-fast up: {instance.name} exited: {_last_line(instance)}", file=sys.stderr)
                return False
        time.sleep(0.2)
    print("sdcp-fast up: the router saw no live verifier and drafter in time", file=sys.stderr)
    return False


def _last_line(instance: Instance) -> str:
    lines = [line for line in instance.log_tail(20).splitlines() if line.strip()]
    return lines[-1] if lines else "(no log)"
