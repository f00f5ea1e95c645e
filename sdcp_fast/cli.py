"""`sdcp-fast`: the command line.

    sdcp-fast digest CONTRACT [--prompt 1,2,3]   contract digest (and d[0]) of a JSON or CBOR contract
    sdcp-fast certs DIR URI... [--days N]        a CA and one certificate per instance URI
    sdcp-fast serve ROLE --config FILE           one verifier, drafter or router instance
    sdcp-fast demo                               the whole system on one machine
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


def _load_contract(path: Path) -> Contract:
    raw = path.read_bytes()
    if path.suffix == ".json":
        obj = json.loads(raw)
        # JSON has no byte strings: hash32 and scope members are written as hex
        for key in ("target", "tokenizer", "scope"):
            if isinstance(obj.get(key), str):
                obj[key] = bytes.fromhex(obj[key])
        if isinstance(obj.get("drafters"), list):
            obj["drafters"] = [bytes.fromhex(d) if isinstance(d, str) else d for d in obj["drafters"]]
        return Contract.from_obj(obj)
    return Contract.from_obj(cbor.loads(raw))


def cmd_digest(args: argparse.Namespace) -> int:
    try:
        contract = _load_contract(Path(args.contract))
    except ProblemError as exc:
        print(f"bad contract: {exc}", file=sys.stderr)
        return 2
    print(f"contract_digest {contract.digest.hex()}")
    if args.prompt is not None:
        prompt = [int(t) for t in args.prompt.split(",") if t]
        print(f"d0              {prefix_digest(contract.digest, prompt).hex()}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from .transport import certs
    return certs.main(["--dir", args.dir, "--days", str(args.days), *args.uris])


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve import main as serve_main
    return serve_main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main
    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdcp-fast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("digest", help="contract digest of a contract file (JSON or CBOR)")
    p.add_argument("contract")
    p.add_argument("--prompt", help="comma-separated prompt tokens: also print d[0]")
    p.set_defaults(func=cmd_digest)

    p = sub.add_parser("certs", help="create a CA and per-instance certificates")
    p.add_argument("dir")
    p.add_argument("uris", nargs="+", help="instance base URIs (the URI SAN of each certificate)")
    p.add_argument("--days", type=int, default=365, help="validity of instance certificates")
    p.set_defaults(func=cmd_certs)

    p = sub.add_parser("serve", help="run one instance (verifier, drafter or router) from a config file")
    p.add_argument("role", choices=["verifier", "drafter", "router"])
    p.add_argument("--config", required=True, help="the instance's TOML config")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="run the whole system on one machine")
    p.add_argument("--prompts", type=int, default=4, help="how many demo prompts")
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--protocol", choices=["h2", "h3"], default="h2")
    p.add_argument("--workdir", default=None, help="certificates, cache and logs (default: a temp dir)")
    p.add_argument("--plot", default=None, help="write a PNG of accepted tokens and m_cap per round")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
