"""Run one parameter server from the command line.

    python -m fleetx.ps serve --cluster cluster.json --index 0 [--load DIR[,DELTA...]]
                              [--save-root DIR]
                              [--log-level INFO]

``cluster.json`` holds ``{"config": PSConfig fields, "tables": Tables.to_json() object}``. The
process prints ``listening <host:port>`` once it accepts connections, serves until every
worker stopped, and exits 0, or 1 naming the worker that was lost. The shared secret comes
from ``FLEETX_PS_SECRET`` or ``FLEETX_PS_SECRET_FILE``, never from the cluster file.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from fleetx.checkpoint import CheckpointError
from fleetx.ps.api import PSConfig, PSError, Tables, settings_from_env
from fleetx.ps.server import PSServer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleetx.ps")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one parameter server")
    serve.add_argument("--cluster", required=True, help="JSON file: config and tables")
    serve.add_argument("--index", type=int, required=True, help="this server's index")
    serve.add_argument("--load", default=None, help="checkpoint folder to start from, or "
                       "base,delta,... (a chain, replayed in order)")
    serve.add_argument("--save-root", default=None,
                       help="folder SAVE requests and --load are confined to (default: the "
                       "cluster file's save_root, else the working directory)")
    serve.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    with open(args.cluster) as f:
        spec = json.load(f)
    settings = settings_from_env()
    secret = {k: v for k, v in (("secret", settings.secret),
                                ("secret_file", settings.secret_file)) if v}
    config = PSConfig(**{**spec["config"], **({"save_root": args.save_root}
                                              if args.save_root else {}), **secret})
    tables = Tables.from_json(json.dumps(spec["tables"]))
    try:
        load = args.load.split(",") if args.load and "," in args.load else args.load
        server = PSServer(config, args.index, tables, load_dir=load).start()
        print(f"listening {server.endpoint}", flush=True)
        server.run()
    except (PSError, CheckpointError) as e:
        print(f"fleetx.ps server {args.index}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
