"""``python -m srt.launch_server [--flags]``: serve the OpenAI-compatible HTTP API.

Every `ServerArgs` field is a flag (``--model-path``, ``--port``, ``--max-running-requests`` ...).
Exit codes: 0 after SIGINT/SIGTERM, 1 when a process failed (at start-up or later), 2 for an invalid
configuration.
"""

from __future__ import annotations

import argparse
import logging
import sys

from srt.server_args import ServerArgs
from srt.utils.errors import ConfigError, LaunchError
from srt.utils.transformers_import import cache_import_structure


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m srt.launch_server", description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    cache_import_structure()  # before anything imports transformers (srt/utils/transformers_import.py)
    server_args = parse_args(argv)
    from srt.entrypoints.http_server import launch_server
    from srt.utils.logging_utils import configure_logging

    configure_logging(server_args.log_level, "main")
    log = logging.getLogger("srt.launch_server")
    try:
        if server_args.node_rank > 0:  # scheduler ranks only, no HTTP server
            from srt.entrypoints.worker_node import run_worker_node

            return run_worker_node(server_args)
        return launch_server(server_args)
    except ConfigError as e:
        log.error("invalid configuration: %s", e)
        return 2
    except LaunchError as e:
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
