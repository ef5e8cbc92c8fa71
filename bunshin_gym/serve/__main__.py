"""``bunshin serve`` (also ``python -m bunshin_gym.serve``): its options and its start."""

from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=49982, help="port (default: 49982)")
    ap.add_argument("--token-file", default=None,
                    help='JSON {"tokens": [{"token", "name", "max_workspaces", "max_memory"}]}; default: one '
                         "token generated into STATE_DIR/token.json")
    ap.add_argument("--state-dir", default=None, help="server state (default: $BUNSHIN_HOME/serve)")
    ap.add_argument("--idle-timeout", type=float, default=900.0,
                    help="seconds without a request before a sandbox or env is reclaimed (0: never)")
    ap.add_argument("--env-ttl", type=float, default=86400.0, help="seconds an env lives at most (0: no limit)")
    ap.add_argument("--max-timeout", type=int, default=86400, help="longest sandbox timeout a client may set")
    ap.add_argument("--memory-mode", default="share", help="memory mode of sandbox forks (share, ksm, copy)")
    ap.add_argument("--close-on-exit", action="store_true",
                    help="close every sandbox when the server stops (default: keep them for the next start)")
    ap.add_argument("--domain", default=None,
                    help="domain of sandbox hosts: get_host(port) is PORT-ID.DOMAIN, which must reach this server "
                         "(e.g. localhost:49982 for curl and browsers, which resolve *.localhost; default: the SDK's)")
    ap.add_argument("--no-local-channel", action="store_true",
                    help="no env channels on a Unix socket for clients on this host (WebSocket ones only)")
    ap.add_argument("--log-level", default="info")


def main(args: argparse.Namespace) -> int:
    from bunshin_gym.serve.app import ServeConfig, run
    from bunshin_gym.serve.auth import TokenFileError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.token_file:
        print("bunshin serve: listening beyond loopback needs --token-file", file=sys.stderr)
        return 2
    config = ServeConfig(host=args.host, port=args.port, token_file=args.token_file, state_dir=args.state_dir,
                         idle_timeout=args.idle_timeout, env_ttl=args.env_ttl or None, max_timeout=args.max_timeout,
                         memory_mode=args.memory_mode, domain=args.domain,
                         local_channel=not args.no_local_channel)
    try:
        run(config, log_level=args.log_level.lower(), close_on_exit=args.close_on_exit)
    except TokenFileError as e:
        print(f"bunshin serve: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bunshin serve")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
