"""`sdcp-fast up [DIR]`: a whole deployment on one machine, serving the OpenAI API until
interrupted (what `vllm serve` is to vLLM: one command to an endpoint).

Without DIR: the demo pair: a verifier (tiny:demo-target), `--drafters` drafters
(tiny:demo-draft) and a router whose front door listens at --host:--port, every instance
with its /metrics and /health on a port of its own, the router's default contract.
With DIR: one instance per `*.toml` file there (each with its `role`; examples/deployment
is one such directory). Relative paths in those files are relative to the work directory,
where certificates are made for every instance unless its certs directory already holds
the operator's CA certificate without the CA key.

Each instance is an `sdcp-fast serve` process with its log in the work directory. Once every
instance serves and the router sees a verifier and a drafter live, one line is printed:

    OpenAI API at http://HOST:PORT/v1

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
from pathlib import Path

from .config import ConfigError, load
from .procs import Cluster, Instance, free_port

POLL_S = 0.5


def plan_demo(cluster: Cluster, host: str, port: int, drafters: int) -> None:
    from .models import load_backend

    target, draft = "tiny:demo-target", "tiny:demo-draft"
    cluster.verifier("verifier", model=target, metrics=f"127.0.0.1:{free_port()}")
    names = [f"drafter-{n}" for n in range(1, drafters + 1)]
    for name in names:
        cluster.drafter(name, model=draft, metrics=f"127.0.0.1:{free_port()}", rounds_log=None)
    digest = load_backend(draft).digest.hex()
    cluster.router(model=target, drafter_models=dict.fromkeys(names, digest), frontdoor=f"{host}:{port}")


def plan_dir(cluster: Cluster, directory: Path) -> None:
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


def main(args: argparse.Namespace) -> int:
    def terminate(signum, frame):    # SIGTERM as Ctrl-C: clean up once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    keep = args.workdir is not None
    root = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix="sdcp-up-"))
    cluster = Cluster(root, protocol=args.protocol)
    try:
        if args.dir:
            directory = Path(args.dir)
            if not directory.is_dir():
                raise ConfigError(f"{args.dir}: no such directory")
            plan_dir(cluster, directory.resolve())
        else:
            plan_demo(cluster, args.host, args.port, args.drafters)
        return serve_until_interrupted(cluster)
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


def serve_until_interrupted(cluster: Cluster) -> int:
    print(f"sdcp-fast up: starting {len(cluster.instances)} instances (logs in {cluster.workdir})",
          file=sys.stderr, flush=True)
    try:
        cluster.start(timeout=120)
    except (RuntimeError, TimeoutError) as exc:
        failed = next((i for i in cluster.instances.values() if i.popen and not i.alive()), None)
        why = _last_line(failed) if failed else str(exc).splitlines()[0]
        print(f"sdcp-fast up: {failed.name if failed else 'start'} failed: {why}", file=sys.stderr)
        return 1
    router = next(i for i in cluster.instances.values() if i.role == "router")
    host = router.config.router.frontdoor.rpartition(":")[0] or "127.0.0.1"
    api = f"http://{host}:{router.info['frontdoor_port']}/v1"
    if not wait_live(router, cluster):
        return 1
    print(f"OpenAI API at {api}", flush=True)
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
