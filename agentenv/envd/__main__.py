"""`python -m agentenv.envd [--host H] [--port P]`: run envd (inside a sandbox, as root)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from agentenv.constants import ENVD_PORT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentenv.envd", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=ENVD_PORT, help=f"TCP port (default: {ENVD_PORT})")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--subreaper", action="store_true",
        help="adopt and reap orphaned descendants (implicit when running as PID 1)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(), format="%(asctime)s envd %(levelname)s %(message)s"
    )
    from agentenv.envd.reaper import become_subreaper
    from agentenv.envd.server import serve

    if args.subreaper:
        try:
            become_subreaper()
        except OSError as exc:  # e.g. older gVisor; inside a sandbox envd is PID 1 anyway
            logging.getLogger("agentenv.envd").warning("cannot become a child subreaper: %s", exc)

    # The default event loop (epoll): runsc >= 20240729 checkpoints epoll listeners.
    asyncio.run(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
